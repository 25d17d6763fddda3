"""The packed target forward (target/packed.py) against the Hugging Face forward, on CPU.

The compiled variant is the same functions under torch.compile; here they run uncompiled
(compiling on a CPU costs tens of seconds), and a test checks that `compile=True` wraps
exactly these functions."""

import functools

import pytest
import torch

from dflash_train.data.batch import pack_documents
import dflash_train.target.packed as packed_module
from dflash_train.target.config import TargetConfig
from dflash_train.target.fp8 import convert_decoder_linears
from dflash_train.target.language_model import text_config
from dflash_train.target.packed import (
    PackedForward,
    UnsupportedTarget,
    post_attention,
    pre_attention,
    rows_hold_one_document,
)
from dflash_train.target.presets import build_random_target
from dflash_train.target.runner import TargetRunner, find_decoder_layers

from .test_runner import tiny_target

TAPS = [1, 3, 4]


@functools.cache
def _target(kind):
    """Built once per kind (tests that change a model build their own: `_fresh`)."""
    return _fresh(kind)


def _fresh(kind):
    if kind == "tiny":  # the `tiny` preset: Qwen3 blocks (q/k norms), GQA, random weights
        return build_random_target("preset:tiny", dtype=torch.float32, device="cpu", seed=3)
    if kind == "qwen3_moe":  # 8 experts, 2 a token, in every layer but layer 2 (a dense MLP)
        from transformers import AutoModelForCausalLM

        from tests.families import _qwen3_moe

        cfg = _qwen3_moe(300)
        cfg.num_hidden_layers, cfg.mlp_only_layers, cfg.initializer_range = 6, [2], 0.05
        torch.manual_seed(5)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if kind in ("gemma3_text", "gemma2", "gemma3"):  # windows of 8 (documents run to 40 tokens); Gemma 2's
        from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration  # capped scores; Gemma 3's
                                                                                       # multimodal checkpoint
        from tests.families import _gemma2, _gemma3, _gemma3_text

        whole = _gemma3(300) if kind == "gemma3" else None
        cfg = whole.text_config if whole is not None else (_gemma3_text if kind == "gemma3_text" else _gemma2)(300)
        cfg.num_hidden_layers, cfg.layer_types = 6, ["sliding_attention", "sliding_attention", "full_attention"] * 2
        if kind == "gemma2":
            cfg.attn_logit_softcapping = 2.0  # small enough that uncapped scores would differ
        torch.manual_seed(6)
        if whole is not None:
            whole._attn_implementation = "eager"
            model = Gemma3ForConditionalGeneration(whole).eval()
        else:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():  # Gemma's norms start at 0 (scale 1): perturb them too
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.1)
        return model
    if kind == "gpt_oss":  # sinks, windows of 8, 8 experts with biases, YaRN
        from transformers import AutoModelForCausalLM

        from tests.families import build_model

        cfg = build_model("gpt_oss", 300).config
        cfg.num_hidden_layers, cfg.layer_types = 6, ["sliding_attention", "full_attention"] * 3
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        with torch.no_grad():  # sinks, biases and norms start at constants: perturb every tensor
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return model
    if kind in ("mistral_window", "qwen2_window", "phi3_window"):
        return _windowed(kind)
    if kind == "glm4_moe":
        return _glm4_moe()
    if kind == "olmo2":  # norms after attention and the MLP; six layers
        from transformers import AutoModelForCausalLM

        from tests.families import _olmo2, perturbed

        cfg = _olmo2(300)
        cfg.num_hidden_layers = 6
        return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=11).eval()
    if kind in ("smollm3", "seed_oss", "minimax_m2", "exaone4", "ernie4_5_moe"):
        return _llama_like(kind)
    if kind in ("deepseek_v3", "deepseek_v3_q_proj", "glm4_moe_lite"):
        return _latent(kind)
    if kind in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        return _hybrid(kind)
    if kind == "mixtral":  # 8 experts, 2 a token, windows of 8; six layers
        from transformers import AutoModelForCausalLM

        from tests.families import _mixtral, perturbed

        cfg = _mixtral(300)
        cfg.num_hidden_layers = 6
        return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=10).eval()
    return tiny_target(kind)


def _windowed(kind):
    """Windows of 8 keys: in every layer (Mistral; Phi-3, with fused q/k/v and gate/up projections and
    RoPE over half of each head), in the upper four of six (Qwen2's use_sliding_window)."""
    from transformers import AutoModelForCausalLM

    from tests.families import WINDOW, _mistral, _phi3, _qwen2

    if kind == "qwen2_window":
        cfg = _qwen2(300)
        cfg.use_sliding_window, cfg.sliding_window = True, WINDOW
        cfg.layer_types = ["full_attention"] * 2 + ["sliding_attention"] * 4
    else:
        cfg = _mistral(300, WINDOW) if kind == "mistral_window" else _phi3(300, WINDOW, rotary=0.5)
    cfg.num_hidden_layers = 6
    torch.manual_seed(8)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _llama_like(kind):
    """Six layers of SmolLM3 (layers 1 and 4 without RoPE), Seed-OSS (biased q/k/v and output
    projections), MiniMax-M2 or EXAONE 4 (tests/families.py), at the families' wide init."""
    from transformers import AutoModelForCausalLM

    from tests.families import FAMILIES, perturbed

    cfg = FAMILIES[kind].config(300)
    cfg.num_hidden_layers, cfg.layer_types = 6, ["full_attention"] * 6
    if kind == "smollm3":
        cfg.no_rope_layers = [1, 0, 1, 1, 0, 1]
    if kind == "exaone4":  # windows of 8 with RoPE, global layers without
        cfg.layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    torch.manual_seed(12)
    return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=12).eval()


def _latent(kind):
    """Latent attention (tests/families.py) over six layers, a dense first layer then GLM's router:
    DeepSeek-V3 (a query rank, RoPE in interleaved pairs), GLM-4.7-Flash, and a DeepSeek-V3 with a
    plain q_proj, RoPE in halves and YaRN's attention scale."""
    from transformers import AutoModelForCausalLM

    from tests.families import FAMILIES, perturbed

    cfg = FAMILIES["deepseek_v3" if kind == "deepseek_v3_q_proj" else kind].config(300)
    cfg.num_hidden_layers = 6
    if kind == "glm4_moe_lite":  # (its config lists each layer's MLP)
        cfg.mlp_layer_types = ["dense"] + ["sparse"] * 5
    if kind == "deepseek_v3_q_proj":
        cfg.q_lora_rank, cfg.rope_interleave = None, False
        cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                               "mscale_all_dim": 0.7, "original_max_position_embeddings": 128}
    torch.manual_seed(13)
    return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=13).eval()


HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _hybrid(kind):
    """Qwen3-Next (MoE with a gated shared expert; a dense MLP in layer 2), Qwen3.5 and Qwen3.5-MoE
    over six layers, gated delta-rule linear attention in all but layers 3 and 5 (tests/families.py)."""
    from transformers import AutoModelForCausalLM

    from tests.families import FAMILIES, perturbed

    cfg = FAMILIES[kind].config(300)
    cfg.num_hidden_layers = 6
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]
    if kind == "qwen3_next":
        cfg.mlp_only_layers = [2]
    torch.manual_seed(14)
    return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=14).eval()


def _glm4_moe():
    """GLM-4.5's layout at toy size (tests/families.py): a dense first layer, then 8 routed experts (2
    a token) in two groups of which one is kept, a shared expert, scores corrected by a bias and
    scaled, q/k norms, biased q/k/v, RoPE over half of each head; six layers."""
    from transformers import AutoModelForCausalLM

    from tests.families import _glm4_moe as config, perturbed

    cfg = config(300)
    cfg.num_hidden_layers = 6
    torch.manual_seed(9)
    return perturbed(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), seed=9).eval()


def _packed(lengths, rows, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [(i, torch.randint(0, vocab, (n,), generator=g), torch.ones(n, dtype=torch.bool))
            for i, n in enumerate(lengths)]
    return pack_documents(docs, rows)


BATCHES = {
    "one-document-rows": ([40, 33, 12], [[0], [1], [2]]),  # padded rows of one document each
    "several-documents": ([7, 5, 9, 3, 11], [[0, 1], [2, 3], [4]]),
    # 17 documents, the longest 17 tokens: the gathered batch is rounded up to [18, 18]
    "rounded-documents": ([3, 17, 5, 9, 2, 11, 6, 4, 8, 13, 7, 1, 10, 12, 5, 3, 9],
                          [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [14, 15, 16]]),
}


def _run(model, batch, need_final, **kw):
    runner = TargetRunner(model, TAPS, need_final=need_final, **kw)
    try:
        return runner.run_batch(batch, torch.device("cpu"))
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["tiny", "llama", "qwen3_moe", "glm4_moe", "mixtral", "gemma2", "gemma3_text", "gemma3",
                                  "gpt_oss", "mistral_window", "qwen2_window", "phi3_window", "olmo2", "smollm3",
                                  "seed_oss", "minimax_m2", "exaone4", "ernie4_5_moe", "deepseek_v3", "deepseek_v3_q_proj",
                                  "glm4_moe_lite", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layout", list(BATCHES))
@pytest.mark.parametrize("need_final", [False, True])
@pytest.mark.parametrize("documents", ["gather", "flex"])
def test_packed_forward_equals_the_hugging_face_forward(kind, layout, need_final, documents, monkeypatch):
    """Both ways of keeping a row's documents apart (target.document_attention): each document
    gathered for SDPA, or FlexAttention under the packed rows' block mask (here uncompiled:
    compiling on a CPU costs tens of seconds; the GPU tests compile it)."""
    monkeypatch.setattr(packed_module, "compiled_once", lambda fn, **options: fn)
    model = _target(kind)
    batch = _packed(*BATCHES[layout], vocab=text_config(model.config).vocab_size)
    assert rows_hold_one_document(batch.document_ids, batch.position_ids) == (layout == "one-document-rows")
    if kind in HYBRIDS and documents == "flex":  # linear attention reads whole documents: refused, one line
        with pytest.raises(ValueError, match="linear-attention layers read whole documents"):
            _run(model, batch, need_final, forward="packed", document_attention=documents)
        return
    _assert_packed_equals_hf(model, batch, kind, need_final, document_attention=documents)


def _assert_packed_equals_hf(model, batch, kind, need_final, **packed):
    ref = _run(model, batch, need_final)
    got = _run(model, batch, need_final, forward="packed", **packed)
    assert got.taps.shape == ref.taps.shape and got.taps.abs().max() > 0
    # a token's experts are summed in another order than transformers' (fp32 rounding: ~1e-6);
    # a wrong route or weight moves the states by whole percents
    # (Gemma's states are ~10x larger: its embedding is scaled by sqrt(hidden))
    tol = dict(atol=1e-6, rtol=1e-5)
    # (the windowed Mistral, Qwen2 and Phi-3 models use the families' wide init: states ~18, rounding ~2e-5;
    # a window one key too wide moves them by ~10)
    wide = ("gpt_oss", "mistral_window", "qwen2_window", "phi3_window", "glm4_moe", "mixtral", "olmo2", "smollm3",
            "seed_oss", "minimax_m2", "exaone4", "ernie4_5_moe", "deepseek_v3", "deepseek_v3_q_proj", "glm4_moe_lite", "qwen3_next", "qwen3_5",
            "qwen3_5_moe")
    if kind in ("qwen3_moe", "gemma2", "gemma3_text", "gemma3", *wide):
        tol = dict(atol=5e-5 if kind in wide else 1e-5, rtol=1e-4)
    torch.testing.assert_close(got.taps, ref.taps, **tol)
    assert (got.taps[batch.document_ids < 0] == 0).all()
    if need_final:
        torch.testing.assert_close(got.final_hidden, ref.final_hidden, **tol)
    else:
        assert got.final_hidden is None and ref.final_hidden is None


@pytest.mark.parametrize("kind", ["tiny", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss", "mistral_window", "olmo2",
                                  "qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("documents", ["gather", "flex"])
def test_grouped_keys_give_the_taps_of_repeated_ones(kind, documents, monkeypatch):
    """target.grouped_kv: one key/value head a group of query heads (enable_gqa) in both document
    attentions; latent attention (deepseek_v3) has its own keys per head."""
    monkeypatch.setattr(packed_module, "compiled_once", lambda fn, **options: fn)
    model = _target(kind)
    batch = _packed(*BATCHES["several-documents"], vocab=text_config(model.config).vocab_size)
    if kind in HYBRIDS and documents == "flex":
        return  # (refused: the test above)
    seen = []
    real = packed_module.F.scaled_dot_product_attention
    monkeypatch.setattr(packed_module.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q.shape[1], k.shape[1], kw.get("enable_gqa"))) or real(
                            q, k, v, **kw))
    _assert_packed_equals_hf(model, batch, kind, True, document_attention=documents, grouped_kv=True)
    cfg = text_config(model.config)
    # the packed forward's SDPA calls take the keys' own heads (gpt-oss, the windowed Mistral and Gemma 2,
    # whose scores are soft-capped, attend through FlexAttention on every layer)
    if documents == "gather" and kind not in ("deepseek_v3", "gpt_oss", "mistral_window", "gemma2"):
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, True) in seen


def test_flex_document_attention_needs_the_packed_forward():
    with pytest.raises(ValueError, match="flex"):
        TargetRunner(_target("tiny"), TAPS, document_attention="flex")
    with pytest.raises(ValueError, match="document_attention: flex needs target.forward: packed"):
        TargetConfig(forward="hf", document_attention="flex")
    assert TargetConfig(document_attention="flex").forward == "auto"  # decided with the model (it takes packed)
    assert TargetConfig(forward="packed", document_attention="flex").document_attention == "flex"


def test_grouped_keys_need_the_packed_forward_and_a_kernel_that_takes_them():
    from dflash_train.target.config import decide_forward

    with pytest.raises(ValueError, match="grouped_kv needs target.forward: packed"):
        TargetConfig(forward="hf", grouped_kv=True)
    with pytest.raises(ValueError, match="memory-efficient SDPA kernel takes no grouped keys"):
        TargetConfig(forward="packed", sdpa_backend="efficient", grouped_kv=True)
    tiny = _target("tiny").config  # auto on a CPU: the packed forward, which alone has grouped keys
    assert decide_forward(TargetConfig(grouped_kv=True), tiny, torch.device("cpu"))[0].forward == "packed"
    assert decide_forward(TargetConfig(), tiny, torch.device("cpu"))[0].forward == "hf"


def test_the_document_gather_is_what_keeps_documents_apart():
    """Rows of several documents run as one causal row differ from the reference: the
    per-document attention path is needed (and the one-document shortcut is not taken)."""
    model = _target("tiny")
    batch = _packed(*BATCHES["several-documents"], vocab=512)
    ref = _run(model, batch, False)
    runner = TargetRunner(model, TAPS, forward="packed")
    wrong = runner(batch.input_ids, batch.position_ids, batch.document_ids, one_document_rows=True)
    assert not torch.allclose(wrong.taps, ref.taps, atol=1e-4)


@pytest.mark.parametrize("forward", ["hf", "packed"])
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_a_forced_sdpa_kernel_gives_the_same_taps(forward, backend):
    model = _target("tiny")
    batch = _packed(*BATCHES["several-documents"], vocab=512)
    ref = _run(model, batch, True)
    got = _run(model, batch, True, forward=forward, sdpa=backend)
    torch.testing.assert_close(got.taps, ref.taps, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.final_hidden, ref.final_hidden, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("forward", ["hf", "packed"])
def test_the_forced_kernel_is_really_forced(forward):
    """cuDNN attention does not exist on a CPU: forcing it must fail, not fall back silently."""
    model = _target("tiny")
    batch = _packed(*BATCHES["one-document-rows"], vocab=512)
    with pytest.raises(RuntimeError, match="No viable backend"):
        _run(model, batch, False, forward=forward, sdpa="cudnn")


@pytest.mark.parametrize("need_final", [False, True])
def test_packed_forward_stops_after_the_last_tapped_layer(need_final):
    model = _target("tiny")  # 6 layers, taps up to layer 4
    batch = _packed(*BATCHES["one-document-rows"], vocab=512)
    runner = TargetRunner(model, TAPS, need_final=need_final, forward="packed")
    calls = []
    inner = runner.packed.pre_attention
    runner.packed.pre_attention = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    runner.run_batch(batch, torch.device("cpu"))
    assert len(calls) == (6 if need_final else max(TAPS) + 1)


def test_compiled_mode_wraps_the_tested_functions():
    model = _target("tiny")
    plain = TargetRunner(model, TAPS, forward="packed").packed
    assert plain.pre_attention is pre_attention and plain.post_attention is post_attention
    compiled = TargetRunner(model, TAPS, forward="packed", compile=True).packed  # nothing runs yet
    assert getattr(compiled.pre_attention, "_torchdynamo_orig_callable", None) is pre_attention
    assert getattr(compiled.post_attention, "_torchdynamo_orig_callable", None) is post_attention


@pytest.mark.parametrize("kind", ["tiny", "phi3_window", "deepseek_v3"])
def test_packed_fp8_equals_the_fp8_linear_modules(kind):
    """FP8: the packed forward quantises each shared input once; the Hugging Face forward's
    FP8Linear modules quantise it per projection; the quantised numbers are the same (Phi-3: row
    blocks of its fused projections, each with its rows' scales; DeepSeek-V3: the latent
    attention's five projections)."""
    model = _fresh(kind)
    batch = _packed(*BATCHES["several-documents"], vocab=model.config.vocab_size)
    bf = _run(model, batch, True)
    convert_decoder_linears(model, find_decoder_layers(model))
    ref = _run(model, batch, True)
    got = _run(model, batch, True, forward="packed")
    tol = dict(atol=1e-6, rtol=1e-5) if kind == "tiny" else dict(atol=5e-5, rtol=1e-4)  # states ~18, windows, MoE
    torch.testing.assert_close(got.taps, ref.taps, **tol)
    torch.testing.assert_close(got.final_hidden, ref.final_hidden, **tol)
    assert not torch.allclose(got.taps, bf.taps, atol=1e-6)  # FP8 did change the numbers ...
    # ... by a little (the wide init puts more of the weights far from the scale; DeepSeek-V3's router
    # may then choose another expert for a token near a tie)
    bound = {"tiny": 0.1, "phi3_window": 0.25, "deepseek_v3": 0.4}[kind]
    assert float((got.taps - bf.taps).norm() / bf.taps.norm()) < bound


def test_rows_hold_one_document():
    ids = torch.tensor([[0, 0, 0, -1], [1, 1, -1, -1]])
    pos = torch.tensor([[0, 1, 2, 0], [0, 1, 0, 0]])
    assert rows_hold_one_document(ids, pos)
    assert not rows_hold_one_document(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 1, 0, 1]]))


def test_unsupported_targets_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedTarget, match="target.forward: hf"):
        PackedForward(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)), [0])
