"""The packed forward's mixture of experts (target/moe.py) against a token-by-token loop."""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.target.moe import grouped_offsets, moe_mlp


def _brute(h, router_w, gate_up, down, top_k, renormalise):
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(router_w @ h[t], dim=-1)
        weights, experts = probs.topk(top_k)
        if renormalise:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate, up = (gate_up[e] @ h[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("top_k, renormalise", [(1, False), (2, True), (3, False), (6, True)])
def test_moe_mlp_equals_each_token_through_its_top_k_experts(top_k, renormalise):
    g = torch.Generator().manual_seed(top_k)
    E, H, inter, N = 6, 16, 12, 29
    h = torch.randn(N, H, generator=g)
    router_w, gate_up, down = (torch.randn(E, H, generator=g), torch.randn(E, 2 * inter, H, generator=g) / 4,
                               torch.randn(E, H, inter, generator=g) / 4)
    got = moe_mlp(h.view(1, N, H), router_w, gate_up, down, top_k=top_k, renormalise=renormalise)
    torch.testing.assert_close(got.view(N, H), _brute(h, router_w, gate_up, down, top_k, renormalise),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counting", [True, False])
def test_grouped_offsets_sort_pairs_by_expert_and_end_each_group(monkeypatch, counting):
    from dflash_train.target import moe

    monkeypatch.setattr(moe, "COUNTING_LIMIT", 1 << 30 if counting else 0)
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5: experts 2 0 2 3 0 2
    order, inverse, ends = grouped_offsets(experts, 5)
    assert experts.reshape(-1)[order].tolist() == [0, 0, 2, 2, 2, 3]
    assert order.tolist() == [1, 4, 0, 2, 5, 3]  # stable: a token's pairs keep their order
    assert inverse.tolist() == [2, 0, 3, 5, 1, 4]
    assert ends.tolist() == [2, 2, 5, 6, 6] and ends.dtype == torch.int32  # expert 1 and 4 get no rows


@pytest.mark.parametrize("n, k, num_experts", [(1, 1, 4), (37, 8, 128), (300, 2, 7), (64, 4, 64)])
def test_counting_and_sorting_group_the_pairs_alike(monkeypatch, n, k, num_experts):
    """Both ways to group, against a stable sort, on random experts (distinct per token as top-k gives)."""
    from dflash_train.target import moe

    g = torch.Generator().manual_seed(n)
    experts = torch.rand(n, num_experts, generator=g).topk(k, dim=-1).indices
    want = experts.reshape(-1).argsort(stable=True)
    for limit in (1 << 30, 0):
        monkeypatch.setattr(moe, "COUNTING_LIMIT", limit)
        order, inverse, ends = grouped_offsets(experts, num_experts)
        assert torch.equal(order, want) and torch.equal(inverse, want.argsort())
        assert torch.equal(ends, torch.bincount(experts.reshape(-1), minlength=num_experts).cumsum(0).int())


def test_the_per_expert_loop_equals_the_grouped_gemm():
    """The fallback for PyTorch builds without a grouped GEMM on the device: the same products."""
    from dflash_train.target.moe import grouped_mm, _NATIVE_GROUPED_MM, expert_loop_mm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 8, generator=g), torch.randn(4, 8, 12, generator=g)
    offs = torch.tensor([3, 3, 9, 11], dtype=torch.int32)  # expert 1 gets no rows
    want = torch.cat([x[0:3] @ w[0], x[3:9] @ w[2], x[9:11] @ w[3]])
    torch.testing.assert_close(expert_loop_mm(x, w, offs), want)
    if _NATIVE_GROUPED_MM is not None:
        torch.testing.assert_close(_NATIVE_GROUPED_MM(x, w, offs=offs), want)
    odd = torch.randn(4, 8, 5, generator=g)  # rows of 20 bytes: the native kernel refuses them, the loop serves
    torch.testing.assert_close(grouped_mm(x, odd, offs=offs), torch.cat([x[0:3] @ odd[0], x[3:9] @ odd[2],
                                                                          x[9:11] @ odd[3]]))


@pytest.mark.parametrize("dtype,device,capability,syncs", [
    (torch.bfloat16, "cuda", (9, 0), False),  # Hopper's bf16 grouped GEMM: offsets stay on the device
    (torch.bfloat16, "cuda", (10, 0), False),
    (torch.bfloat16, "cuda", (8, 0), True),  # PyTorch's fallback loops on the host
    (torch.float32, "cuda", (9, 0), True),
    (torch.float16, "cuda", (9, 0), True),
    (torch.bfloat16, "cpu", None, True),
])
def test_grouped_mm_syncs_off_hoppers_bf16_kernel(monkeypatch, dtype, device, capability, syncs):
    from dflash_train.target import moe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert moe.grouped_mm_syncs(dtype, torch.device(device)) is syncs


def test_a_decoder_with_experts_is_capturable_only_where_the_grouped_gemm_keeps_offsets_on_device(monkeypatch):
    from dflash_train.generate import decoder as decoder_mod
    from tests.families import build_model

    dense, moe_model = build_model("qwen3", 64), build_model("gpt_oss", 64)
    assert decoder_mod.StaticDecoder(dense, 1, 32).capturable
    assert not decoder_mod.StaticDecoder(moe_model, 1, 32).capturable  # CPU: the expert loop
    monkeypatch.setattr(decoder_mod, "grouped_mm_syncs", lambda dtype, device: False)
    assert decoder_mod.StaticDecoder(moe_model, 1, 32).capturable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_compiles_as_one_graph_and_equals_the_loop(dtype):
    """Compiled (fullgraph, a backend that runs the traced graph as is): float32 goes through the
    opaque op, bfloat16 through the native kernel or the loop, one graph each, the loop's values."""
    from dflash_train.target.moe import expert_loop_mm, grouped_mm

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 8, generator=g).to(dtype), torch.randn(4, 8, 16, generator=g).to(dtype)
    offs = torch.tensor([3, 3, 9, 11], dtype=torch.int32)
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, o: grouped_mm(a, b, offs=o) * 2, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, offs), expert_loop_mm(x, w, offs) * 2)
    assert len(graphs) == 1
    opaque = [n for n in graphs[0].graph.nodes if "grouped_mm_opaque" in str(n.target)]
    assert len(opaque) == (1 if dtype == torch.float32 else 0)


def test_inverse_permutation_undoes_the_order():
    from dflash_train.target.moe import inverse_permutation

    order = torch.randperm(97, generator=torch.Generator().manual_seed(3))
    inverse = inverse_permutation(order)
    assert torch.equal(inverse, order.argsort())
    assert torch.equal(order[inverse], torch.arange(97)) and torch.equal(inverse[order], torch.arange(97))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_combine_weighs_each_tokens_rows_and_rounds_once(dtype, compiled):
    """weighted_sum_by_token, eager and as traced for the compiler (its k row gathers, the traced
    graph run without code generation), against a token-by-token float64 sum of the token's k
    grouped rows (row inverse[t*k + j]): within one rounding."""
    from dflash_train.target.moe import grouped_offsets, weighted_sum_by_token

    g = torch.Generator().manual_seed(7)
    N, k, E, H = 23, 4, 5, 33
    experts = torch.rand(N, E, generator=g).topk(k, dim=-1)[1]
    inverse = grouped_offsets(experts, E).inverse
    y = torch.randn(N * k, H, generator=g).to(dtype)
    weights = torch.rand(N, k, generator=g).softmax(-1).to(dtype)
    exact = torch.stack([sum(weights[t, j].double() * y[inverse[t * k + j]].double() for j in range(k))
                         for t in range(N)])
    graphs = []

    def record(gm, example_inputs):  # the traced graph, run as traced
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    combine = torch.compile(weighted_sum_by_token, backend=record, fullgraph=True) if compiled \
        else weighted_sum_by_token
    got = combine(y, inverse, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), atol=1e-6, rtol=0)
    if compiled:  # the traced form: the k row gathers added up, no reduction over a gathered [N, k, H]
        targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert targets.count("<built-in function add>") == k - 1 and not any("sum" in t for t in targets)
