"""Cache attention (generate/attention.py): the flex kernel applies the same rule as the dense
one, block counts cover every visible key, and a whole engine decodes the same with either.
On CPU FlexAttention runs unfused (eager), which is enough to check the mask semantics."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate import attention
from dflash_train.generate.attention import (
    FLEX_BLOCK,
    CacheAttention,
    blocks_needed,
    cache_index,
    causal_rule,
    decode_attention_for,
    flat,
    folds_gqa,
    write_cache,
)
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.static_drafter import block_rule
from dflash_train.target.loading import load_causal_lm, load_tokenizer

from ..eval.conftest import random_drafter
from .tiny import make_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def reference(rule, q, k, v, positions, scale):
    """Plain loops: every slot, head and query over the keys the rule shows it."""
    s, t, h, d = q.shape
    rep = h // k.shape[1]
    out = torch.zeros(s, t, h, d, dtype=torch.float64)
    for b in range(s):
        for head in range(h):
            for i in range(t):
                keys = [j for j in range(k.shape[2]) if rule(positions[b], torch.tensor(i), torch.tensor(j))]
                kk, vv = k[b, head // rep, keys].double(), v[b, head // rep, keys].double()
                w = torch.softmax(q[b, i, head].double() @ kk.T * scale, -1)
                out[b, i, head] = w @ vv
    return out.reshape(s, t, h * d)


RULES = {"causal": causal_rule, "block": block_rule(4, None, False), "block_causal": block_rule(4, None, True),
         "block_window": block_rule(4, 37, False)}


def keep_flex_unfolded(monkeypatch) -> None:
    """Flex with q in its own layout (native GQA), as a GPU with more SMs than slots x kv heads runs it."""
    monkeypatch.setattr(attention, "folds_gqa", lambda kind, *_: kind == "dense")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("kind", ["dense", "flex", "flex-native-gqa"])
def test_attention_equals_loops(rule, kind, monkeypatch):
    if kind == "flex-native-gqa":
        keep_flex_unfolded(monkeypatch)
        kind = "flex"
    torch.manual_seed(0)
    S, T, H, KV, D, L = 3, 4, 6, 2, 8, 2 * FLEX_BLOCK
    positions = torch.tensor([0, 61, 200])  # block starts: the first slot sees only its own block
    q, k, v = torch.randn(S, T, H, D), torch.randn(S, KV, L, D), torch.randn(S, KV, L, D)
    att = CacheAttention(RULES[rule], kind, slots=S, q_len=T, max_len=L, n_heads=H, n_kv=KV, head_dim=D,
                         scale=0.3, dtype=torch.float32, device=torch.device("cpu"))
    att.prepare(positions, L)
    got = att.attend(q, k, v)
    torch.testing.assert_close(got.double(), reference(RULES[rule], q, k, v, positions, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("folded", [True, False])
def test_flex_gets_gqa_folded_into_query_rows_or_native(t, folded, monkeypatch):
    """Folded (many slots), the flex kernel is handed as many query heads as kv heads, rep*T rows
    each, no enable_gqa: a group of 1, which the compiler's decoding kernel takes (it needs a
    power of two; SmolLM2's 9 heads over 3 are not). Unfolded (a few slots), q keeps its layout
    with enable_gqa. The same numbers either way."""
    if not folded:
        keep_flex_unfolded(monkeypatch)
    torch.manual_seed(0)
    S, H, KV, D, L = 2, 9, 3, 16, FLEX_BLOCK
    positions = torch.tensor([0, 90])
    q, k, v = torch.randn(S, t, H, D), torch.randn(S, KV, L, D), torch.randn(S, KV, L, D)
    rule = causal_rule if t == 1 else block_rule(t, None, False)
    att = CacheAttention(rule, "flex", slots=S, q_len=t, max_len=L, n_heads=H, n_kv=KV, head_dim=D, scale=0.25,
                         dtype=torch.float32, device=torch.device("cpu"))
    calls, kernel = [], att._kernel

    def spy(query, key, value, **kwargs):
        calls.append((tuple(query.shape), kwargs.get("enable_gqa", False), tuple(kwargs["block_mask"].shape)))
        return kernel(query, key, value, **kwargs)

    att._kernel = spy
    att.prepare(positions, L)
    got = att.attend(q, k, v)
    want = [((S, KV, 3 * t, D), False, (S, 1, 3 * t, L))] if folded else [((S, H, t, D), True, (S, 1, t, L))]
    assert calls == want
    torch.testing.assert_close(got.double(), reference(rule, q, k, v, positions, 0.25), atol=1e-5, rtol=1e-5)


def test_flex_folds_gqa_exactly_where_the_decoding_kernel_would_not_split_keys(monkeypatch):
    """Flex folds GQA exactly for the slot counts at which the compiler's decoding kernel
    (torch's own split heuristic, on an H200's 132 SMs) covers the GPU without splitting a
    slot's keys across thread blocks; dense always folds."""
    from types import SimpleNamespace

    get_split_k = pytest.importorskip("torch._inductor.kernel.flex.flex_decoding").get_split_k
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: SimpleNamespace(multi_processor_count=132))
    gpu = torch.device("cuda", 0)
    for n_kv in (3, 8):
        for slots in range(1, 300):
            assert folds_gqa("flex", slots, n_kv, gpu) == (get_split_k(slots, n_kv, 4096) == 1), (slots, n_kv)
            assert folds_gqa("dense", slots, n_kv, gpu)
    assert folds_gqa("flex", 1536, 3, gpu) and not folds_gqa("flex", 1, 3, gpu)  # generate's slots; batch 1


def test_dense_attention_takes_sdpa_outputs_in_any_memory_layout(monkeypatch):
    """CUDA's SDPA kernels may return [S, kv, rep*T, D] laid out as [S, rep*T, kv, D] in memory
    (the GPU engine test caught a `view` that only CPU's layout allowed): same numbers either way."""
    torch.manual_seed(0)
    S, T, H, KV, D, L = 2, 4, 6, 2, 8, 32
    positions = torch.tensor([3, 20])
    q, k, v = torch.randn(S, T, H, D), torch.randn(S, KV, L, D), torch.randn(S, KV, L, D)
    att = CacheAttention(RULES["block"], "dense", slots=S, q_len=T, max_len=L, n_heads=H, n_kv=KV, head_dim=D,
                         scale=0.3, dtype=torch.float32, device=torch.device("cpu"))
    att.prepare(positions, L)
    plain = att.attend(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        o = sdpa(*args, **kwargs)
        return o.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads innermost

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided_sdpa)
    torch.testing.assert_close(att.attend(q, k, v), plain, atol=0, rtol=0)
    torch.testing.assert_close(plain.double(), reference(RULES["block"], q, k, v, positions, 0.3), atol=1e-5, rtol=1e-5)


def test_block_counts_cover_every_visible_key_and_no_more():
    """Brute force over positions: the last visible key of every query lies in the counted
    blocks, and the last counted block holds one (so a slot never reads blocks it has not reached)."""
    L = 4 * FLEX_BLOCK
    for rule, t in ((causal_rule, 1), (causal_rule, 16), (block_rule(16, None, False), 16),
                    (block_rule(16, 64, True), 16)):
        positions = torch.arange(0, L - t + 1)
        counts = blocks_needed(positions + t - 1, L)
        att = CacheAttention(rule, "dense", slots=len(positions), q_len=t, max_len=L, n_heads=2, n_kv=1, head_dim=4,
                             scale=None, dtype=torch.float32, device=torch.device("cpu"))
        visible = att.visible(positions, L)  # [S, T, L]
        last = torch.where(visible.any(1), torch.arange(L), -1).amax(-1)  # last visible key of each slot
        assert torch.equal(counts.long(), last // FLEX_BLOCK + 1)


def test_flex_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 128"):
        CacheAttention(causal_rule, "flex", slots=1, q_len=1, max_len=200, n_heads=2, n_kv=1, head_dim=4,
                       scale=None, dtype=torch.float32, device=torch.device("cpu"))


def test_engine_decodes_the_same_with_flex_and_dense(tiny_targets):
    """Batch of prompts, speculative and greedy, sliding-window and causal drafter layers: the
    flex engine (one step graph for every length) commits exactly what the dense one does."""
    model, tok = load_causal_lm(tiny_targets["qwen3"], dtype=torch.float32), load_tokenizer(tiny_targets["qwen3"])
    drafter = random_drafter(model, tok, 4, sliding=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 17)]
    dense = SpecEngine(model, drafter, set(), slots=2, max_len=256, attention="dense")
    flex = SpecEngine(model, drafter, set(), slots=2, max_len=256, attention="flex")
    assert flex.buckets == [256] and len(dense.buckets) == 2
    for speculative in (True, False):
        a = dense.generate_batch(prompts, 30, speculative=speculative)
        b = flex.generate_batch(prompts, 30, speculative=speculative)
        assert [(r.tokens, r.rounds) for r in a] == [(r.tokens, r.rounds) for r in b]


@pytest.mark.parametrize("layers", [None, 1, 3])
def test_cache_writes_land_where_advanced_indexing_puts_them(layers):
    """write_cache(cache_index(...)) equals cache[(layer,) rows[r], :, grid[r, t]] = values, also
    with non-contiguous values (a slice of a fused projection, as the drafter's v)."""
    S, KV, L, D, T = 4, 3, 16, 5, 4
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 0, 3])
    grid = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [12, 13, 14, 15]])
    n = layers or 1
    shape = (n, S, KV, L, D)
    fused = torch.randn(3, T, n, KV, 2 * D, generator=g)
    values = fused[..., D:]  # non-contiguous [R, T, layers, KV, D]
    got, want = torch.zeros(shape), torch.zeros(shape)
    if layers is None:  # one layer's cache
        write_cache(flat(got[0]), cache_index(rows, grid, KV, L), values[:, :, 0])
    else:
        write_cache(flat(got), cache_index(rows, grid, KV, L, layers, S), values)
    for r in range(3):
        for t in range(T):
            for lay in range(n):
                want[lay, rows[r], :, grid[r, t]] = values[r, t, lay]
    assert torch.equal(got, want)


def test_auto_decode_attention_is_flex_only_on_a_compiled_gpu():
    assert decode_attention_for(torch.device("cuda", 1), compile=True) == "flex"
    assert decode_attention_for("cuda", compile=False) == "dense"  # the fused kernel needs the compiler
    assert decode_attention_for(torch.device("cpu"), compile=True) == "dense"
    # FlexAttention's GPU kernels need heads of >= 16 dims: narrower target or drafter heads take
    # dense from the start (a compile would fail and fall back, warning); unknown widths do not count
    assert decode_attention_for("cuda", compile=True, head_dims=[64, 16]) == "flex"
    assert decode_attention_for("cuda", compile=True, head_dims=[64, 8]) == "dense"
    assert decode_attention_for("cuda", compile=True, head_dims=[None, 64]) == "flex"


def test_head_dim_of_reads_the_decoders_attention_heads():
    from dflash_train.generate.decoder import head_dim_of

    from transformers import Qwen3Config, Qwen3ForCausalLM

    llama = make_model("llama", vocab=64)
    assert head_dim_of(llama) == llama.config.hidden_size // llama.config.num_attention_heads == 16
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert head_dim_of(qwen3) == 8  # an explicit width, not hidden / heads
    assert head_dim_of(torch.nn.Linear(2, 2)) is None  # not a decoder this engine runs


def test_the_compiled_flex_kernel_raises_dynamos_recompile_limit_and_never_lowers_it():
    """An engine's flex entries (rules x query shapes x lse) pass Dynamo's default of 8."""
    from dflash_train.generate import attention

    config = torch._dynamo.config
    with config.patch(recompile_limit=8):
        attention._flex_kernel()
        assert config.recompile_limit == attention.FLEX_RECOMPILE_LIMIT
    with config.patch(recompile_limit=500):
        attention._flex_kernel()
        assert config.recompile_limit == 500
