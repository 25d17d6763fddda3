"""The static-KV decoder on the families whose layers differ from a Llama block: Gemma 2 (soft-capped
scores and logits), Gemma 3 (per-layer-type RoPE, q/k norms; also inside its multimodal wrapper),
gpt-oss (attention sinks, biased experts, YaRN), Mistral with a sliding window, Mixtral (experts
with float32 router weights) and Phi-3 (fused q/k/v and gate/up projections) with one; every one of them with sliding-window layers, filled past
the window by the prompts alone. GLM-4.5's MoE layout (sigmoid router with a score correction and
groups, shared experts, RoPE over half a head) and OLMo 2's (norms after attention and the MLP, q/k
normed over their projection) are checked against the same references, and so are the hybrids
Qwen3-Next and Qwen3.5 (dense and MoE), whose linear-attention states roll back by position.

Each check is against transformers' own eager forward of the same random fp32 model: prefill
logits and taps, verify rounds that roll back part of a block (stale cache entries past the
kept tokens must be masked, then overwritten), `decode` step by step, greedy generation through
the built-in engine (also with its decode step compiled) and through the speculative engine with
drafts accepted in part.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

from dflash_train.generate.builtin import BuiltinEngine
from dflash_train.generate.decoder import StaticDecoder, UnsupportedModelError, check_supported, check_supported_config
from dflash_train.generate.engine import Completion, Request
from dflash_train.generate.hybrid_decoder import static_decoder
from dflash_train.generate.sizing import kv_shape
from dflash_train.speculative.engine import SpecEngine
from dflash_train.target.packed_hybrid import post_mixer_hybrid
from dflash_train.target.language_model import text_config
from tests.families import FAMILIES, WINDOW, build_model
from tests.speculative.test_engine import OracleDrafts

VOCAB = 300
# hybrid stacks: gated delta-rule linear attention in most layers, its state rolled back by position
HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
NAMES = ["gemma2", "gemma3_text", "gemma3", "gpt_oss", "mistral_window", "phi3_window", "mixtral", "exaone4"]
# and, without windows, GLM-4.5's MoE layout, OLMo 2's post-norms, SmolLM3's layers without RoPE,
# Seed-OSS's biased output projection, MiniMax-M2's q/k norms over the projection; latent attention
# (DeepSeek-V3, GLM-4.7-Flash) decoded from its cached latent
EXACT = [*NAMES, "glm4_moe", "olmo2", "smollm3", "seed_oss", "minimax_m2", "ernie4_5_moe", "deepseek_v3",
         "glm4_moe_lite", *HYBRIDS]
LAYERS = [0, 2]


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name, VOCAB) for name in EXACT}


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _hf(model, ids, layers=LAYERS):
    """Logits [T, V] and taps [T, n*H] (hidden_states[l + 1]) of one uncached HF forward."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in layers], -1)


def test_every_family_here_is_windowed_and_taken(models):
    for name in NAMES:
        assert FAMILIES[name].windowed
        assert text_config(models[name].config).sliding_window == WINDOW
        check_supported(models[name])  # raises if the engine would refuse it


@pytest.mark.parametrize("kind", ["dense", "flex"])
@pytest.mark.parametrize("name", EXACT)
def test_prefill_and_verify_equal_the_hugging_face_forward(models, name, kind):
    model = models[name]
    dec = static_decoder(model, slots=3, max_len=128, attention=kind, width=4)
    prompts, slots = _prompts((20, 3, 13)), [2, 0, 1]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        last, taps = dec.prefill_with_taps(ids, torch.tensor([len(p) for p in prompts]), torch.tensor(slots), LAYERS)
    seqs = {}
    for r, (p, s) in enumerate(zip(prompts, slots)):
        ref_logits, ref_taps = _hf(model, p)
        torch.testing.assert_close(last[r], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[r, :len(p)], ref_taps, atol=1e-4, rtol=1e-4)
        seqs[s] = list(p)
    kept = {0: 3, 1: 1, 2: 2}  # tokens of each block a slot keeps: the rest is stale in the cache
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # every slot ends past the window
        blocks = torch.randint(4, VOCAB, (3, 4), generator=g)
        positions = torch.tensor([len(seqs[s]) for s in range(3)])
        with torch.no_grad():
            logits, taps = dec.verify(blocks, positions, 128, LAYERS)
        for s in range(3):
            ref_logits, ref_taps = _hf(model, seqs[s] + blocks[s].tolist())
            torch.testing.assert_close(logits[s], ref_logits[-4:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(taps[s], ref_taps[-4:], atol=1e-4, rtol=1e-4)
            seqs[s] += blocks[s].tolist()[:kept[s]]
    assert min(map(len, seqs.values())) > WINDOW


@pytest.mark.parametrize("name", EXACT)
def test_decode_steps_equal_the_hugging_face_forward(models, name):
    model = models[name]
    dec = static_decoder(model, slots=2, max_len=64)
    prompts = _prompts((11, 4), seed=3)
    ids = torch.tensor([p + [0] * (11 - len(p)) for p in prompts])
    with torch.no_grad():
        dec.prefill(ids, torch.tensor([11, 4]), torch.tensor([0, 1]))
    seqs = [list(p) for p in prompts]
    g = torch.Generator().manual_seed(7)
    for _ in range(WINDOW + 2):  # the short prompt's slot too decodes past the window
        tokens = torch.randint(4, VOCAB, (2,), generator=g)
        with torch.no_grad():
            logits = dec.decode(tokens, torch.tensor([len(s) for s in seqs]), 32)
        for s in range(2):
            seqs[s].append(int(tokens[s]))
            tol = 1e-3 if name in HYBRIDS else 1e-4  # the reference: the chunked rule over the whole sequence
            torch.testing.assert_close(logits[s], _hf(model, seqs[s])[0][-1], atol=tol, rtol=tol)


def _hf_greedy(model, prompt, new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", EXACT)
def test_the_builtin_engine_generates_hugging_face_greedy(models, name):
    model = models[name]
    model.generation_config.eos_token_id = None
    prompts = _prompts((17, 5, 9), seed=11)
    engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=24, max_new_tokens=16, stop_ids=set())
    results: dict[int, Completion] = {}
    queue = iter([Request(prompt_ids=p, max_new_tokens=16, tag=i) for i, p in enumerate(prompts)])
    engine.run(lambda: next(queue, None), lambda req, comp: results.__setitem__(req.tag, comp))
    assert [results[i].token_ids for i in range(3)] == [_hf_greedy(model, p, 16) for p in prompts]


def _verify_past_a_block(dec, model):
    """Two slots prefilled with 140 and 150 tokens, then one verify of 4: logits against HF."""
    prompts = _prompts((140, 150), seed=13)
    ids = torch.tensor([p + [0] * (150 - len(p)) for p in prompts])
    with torch.no_grad():
        dec.prefill(ids, torch.tensor([140, 150]), torch.tensor([0, 1]))
    blocks = torch.randint(4, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = dec.verify(blocks, torch.tensor([140, 150]), dec.max_len)
    for s in range(2):
        torch.testing.assert_close(logits[s], _hf(model, prompts[s] + blocks[s].tolist())[0][-4:], atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma3_text"])
def test_flex_skips_the_blocks_before_a_window_and_still_equals_the_forward(models, name):
    """Without a ring (one would be as long as the cache here), past the first 128-key block plus
    the window a sliding-window layer's flex attention reads from the block holding its window's
    first key: one block, where a full layer reads two."""
    model = models[name]
    dec = StaticDecoder(model, slots=2, max_len=256, attention="flex", width=64)  # a ring: 8 + 128 keys, whole blocks
    assert dec.cache_lens == [256] * len(dec.layers)
    _verify_past_a_block(dec, model)
    windowed, full = dec._attentions[(2, 4, WINDOW, 256)], dec._attentions[(2, 4, None, 256)]
    assert windowed.num_blocks.flatten().tolist() == [1, 1] and full.num_blocks.flatten().tolist() == [2, 2]
    assert windowed.indices[:, 0, 0, 0].tolist() == [1, 1]


@pytest.mark.parametrize("kind", ["dense", "flex"])
@pytest.mark.parametrize("name", ["gpt_oss", "gemma3_text", "mistral_window"])
def test_sliding_window_layers_keep_a_ring_and_still_equal_the_forward(models, name, kind):
    """A sliding-window layer's cache is a ring of W + 2B positions (whole 128-key blocks for flex)
    where that is shorter than the cache: the prompts past it keep only their last W positions,
    and a verify past the ring's length still equals the forward."""
    model = models[name]
    dec = StaticDecoder(model, slots=2, max_len=512, attention=kind, width=4)
    ring = 128 if kind == "flex" else WINDOW + 8
    assert dec.cache_lens == [ring if lay.window else 512 for lay in dec.layers]
    assert {lay.window for lay in dec.layers} >= {WINDOW}
    assert all(dec.k_layers[i].shape[2] == n for i, n in enumerate(dec.cache_lens))
    _verify_past_a_block(dec, model)
    with pytest.raises(ValueError, match="blocks of up to 4"):
        dec.verify(torch.zeros(2, 5, dtype=torch.long), torch.tensor([154, 164]), 512)


@pytest.mark.parametrize("attention", ["dense", "flex"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gpt_oss", "qwen3_5_moe"])
def test_the_compiled_decode_step_traces_each_function_once_and_matches(models, name, attention):
    """The GPU path compiles the decode step's per-layer functions as one graph each (fullgraph): on
    a CPU, with a backend that runs the traced graph as is, every layer kind traces once, nothing
    recompiles during the run, and the tokens equal the uncompiled engine's."""
    model = models[name]
    model.generation_config.eos_token_id = None
    traced: list[int] = []

    def recording_backend(gm, example_inputs):
        traced.append(len(gm.graph.nodes))
        return gm.forward

    def tokens(compiled: bool):
        engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=16, max_new_tokens=12, stop_ids=set(),
                               attention=attention)
        if compiled:
            engine._compile_layer_functions(backend=recording_backend)
            assert engine.attention == attention  # no fallback
        results: dict[int, Completion] = {}
        queue = iter([Request(prompt_ids=p, max_new_tokens=12, tag=i) for i, p in enumerate(_prompts((14, 3, 9)))])
        engine.run(lambda: next(queue, None), lambda req, comp: results.__setitem__(req.tag, comp))
        return [results[i].token_ids for i in range(3)]

    want = tokens(False)
    torch._dynamo.reset()
    assert tokens(True) == want
    # dense: pre_attention, post_attention; flex: q_writing_kv, post_attention, final_logits; a
    # hybrid's, always `verify` of one token: those three, the linear-attention layer and its MLP
    assert len(traced) == (5 if name in HYBRIDS else 2 if attention == "dense" else 3)


@pytest.mark.parametrize("name", [*NAMES, "deepseek_v3", "glm4_moe_lite", *HYBRIDS])
def test_the_speculative_engine_with_partial_acceptance_equals_hugging_face_greedy(models, name):
    """The static speculative engine on these targets, drafts scripted to be accepted in part
    (all, none, one, all but one, ...) over rounds that run past the window: its output is
    transformers' greedy decoding, and every round accepted what the script allowed."""
    model, block, pattern = models[name], 4, [3, 0, 1, 2]
    model.generation_config.eos_token_id = None
    prompt = _prompts((20,), seed=17)[0]
    ref = _hf_greedy(model, prompt, 29)
    engine = SpecEngine(model, OracleDrafts({tuple(prompt): ref}, block, pattern, VOCAB), set(), max_len=128)
    out = engine.generate(prompt, 29)
    assert out.tokens == ref
    accepted = [r.accepted for r in out.rounds]
    assert {0, 1, 2, 3} <= set(accepted) and len(out.rounds) >= 8


@pytest.mark.parametrize("kind", ["dense", "flex"])
@pytest.mark.parametrize("name", NAMES)
def test_the_generate_job_sizes_the_cache_the_decoder_allocates(models, name, kind):
    """`--batch-size auto` divides memory by the KV size per slot it computes from the config alone:
    the bytes the built-in engine's decoder then allocates, rings included."""
    model, max_len = models[name], 1024
    shape = kv_shape(text_config(model.config), max_len, torch.float32, kind)
    dec = StaticDecoder(model, slots=3, max_len=max_len, attention=kind)
    assert shape.ring_layers == sum(n < max_len for n in dec.cache_lens) > 0
    assert shape.bytes_per_slot * 3 == dec.kv_bytes() < 2 * len(dec.layers) * 3 * dec.n_kv * max_len * dec.head_dim * 4


def test_a_rope_that_depends_on_the_length_is_refused_in_any_layer_type():
    """Gemma 3 keeps one set of RoPE parameters per layer type: a dynamic one on its full layers
    alone cannot be a fixed table either."""
    cfg = FAMILIES["gemma3_text"].config(VOCAB)
    cfg.rope_parameters = {"full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic'"):
        check_supported_config(cfg)


def test_gemma_3_decodes_as_its_forward_whatever_its_attention_cap_field_says():
    """Gemma 3's config has Gemma 2's `attn_logit_softcapping`, which its forward never applies:
    the decoder does not either."""
    cfg = FAMILIES["gemma3_text"].config(VOCAB)
    cfg.attn_logit_softcapping = 2.0  # low enough to change the scores of a random model
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    dec = StaticDecoder(model, slots=1, max_len=64)
    assert dec.score_cap is None
    prompt = _prompts((20,), seed=19)[0]
    with torch.no_grad():
        logits = dec.prefill(torch.tensor([prompt]), torch.tensor([20]), torch.tensor([0]))
    torch.testing.assert_close(logits[0], _hf(model, prompt)[0][-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite"])
def test_latent_attention_caches_one_head_of_latent_and_rotary_key(models, name):
    """DeepSeek-V3 and GLM-4.7-Flash cache kv_rank + rope numbers a token and layer (one head every
    query head reads), not each head's keys and values; `--batch-size auto` sizes that cache."""
    model, max_len = models[name], 256
    cfg = text_config(model.config)
    dec = StaticDecoder(model, slots=2, max_len=max_len)
    assert (dec.n_kv, dec.head_dim) == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    per_token = 2 * len(dec.layers) * dec.head_dim * 4  # keys and values, fp32
    assert dec.kv_bytes() == 2 * max_len * per_token == kv_shape(cfg, max_len, torch.float32).bytes_per_slot * 2
    expanded = 2 * len(dec.layers) * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * 4
    assert per_token < expanded


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_generate_job_sizes_a_hybrids_cache_and_states_as_the_decoder_allocates_them(models, name):
    """A hybrid's slot holds a KV cache in its attention layers only, and in each linear-attention
    layer a float32 state and a ring of inputs: `--batch-size auto` counts what the decoder allocates."""
    model, max_len = models[name], 256
    cfg = text_config(model.config)
    shape = kv_shape(cfg, max_len, torch.float32)
    dec = static_decoder(model, slots=3, max_len=max_len)
    assert shape.layers == len(dec.layers) == cfg.layer_types.count("full_attention") == 1
    assert shape.state_bytes > 0 and shape.bytes_per_slot * 3 == dec.kv_bytes()


def test_a_linear_attention_layer_of_another_layout_is_refused(models):
    model = build_model("qwen3_5", VOCAB)
    model.model.layers[0].linear_attn.activation = "gelu"
    with pytest.raises(UnsupportedModelError, match="linear-attention activation 'gelu'"):
        check_supported(model)
    with pytest.raises(TypeError, match="static_decoder"):
        StaticDecoder(models["qwen3_5"], slots=1, max_len=32)


def test_the_speculative_engine_compiles_a_hybrids_layer_functions_and_still_equals_greedy(models):
    """The GPU path compiles the hybrid decoder's functions, the MLP after linear attention among
    them; with a non-fusing backend on a CPU, rounds accepted in part still give transformers'
    greedy tokens."""
    model = models["qwen3_5"]
    model.generation_config.eos_token_id = None
    prompt = _prompts((12,), seed=23)[0]
    ref = _hf_greedy(model, prompt, 17)
    torch._dynamo.reset()
    engine = SpecEngine(model, OracleDrafts({tuple(prompt): ref}, 4, [3, 0, 2], VOCAB), set(), max_len=64)
    engine._compile_layer_functions(backend="aot_eager")
    assert engine.decoder.post_mixer is not post_mixer_hybrid and engine.attention == "dense"
    assert engine.generate(prompt, 17).tokens == ref


@pytest.mark.parametrize("kind", ["dense", "flex"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_prefills_prompts_of_several_chunks_and_verifies_past_them(models, name, kind):
    """Prompts of 140 and 150 tokens: the chunked delta rule runs three 64-token chunks, the shorter
    prompt's padding masked out of its state; a verify from there equals the forward."""
    _verify_past_a_block(static_decoder(models[name], slots=2, max_len=256, attention=kind, width=4), models[name])
