"""bench/profile_generate.py: the decode-step table's fields and arithmetic (not its timings)."""

import pytest

from .scripts import load_script

profile_generate = load_script("bench/profile_generate.py")


def test_kernel_names_fall_into_their_categories():
    classify = profile_generate.classify
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert classify("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "matmul"
    assert classify("aten::mm") == "matmul" and classify("aten::addmm") == "matmul"
    assert classify("triton_tem_fused_flex_attention_0") == "attention"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>") == "sampling"
    assert classify("aten::argmax") == "sampling"
    assert classify("triton_poi_fused_add_mul_rsqrt_0") == "other" and classify("aten::index_put_") == "other"


def test_busy_time_is_the_union_of_intervals():
    assert profile_generate.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert profile_generate.busy_us([]) == 0


def test_kv_bytes_read_by_each_attention_kind():
    kv = profile_generate.kv_read_bytes
    assert kv([10, 130, 300], "dense", 512, 7) == 3 * 512 * 7  # every slot up to the bucket
    assert kv([10, 130, 300], "flex", 512, 7) == (128 + 256 + 384) * 7  # each slot's own 128-key blocks
    # two layers, the second with a 100-key window: from the block holding the window's first key
    assert kv([10, 130, 300], "flex", 512, 7, [(None, None), (100, None)]) == (128 + 256 + 384 + 128 + 256 + 256) * 7
    assert kv([10, 130, 300], "dense", 512, 7, [(None, None), (100, None)]) == 2 * 3 * 512 * 7  # every layer whole
    # the second layer's cache a ring of 256 keys: at most all of it
    assert kv([10, 130, 300], "flex", 512, 7, [(None, None), (100, 256)]) == (128 + 256 + 384 + 128 + 256 + 256) * 7
    assert kv([10, 130, 300], "dense", 512, 7, [(None, None), (100, 256)]) == 3 * (512 + 256) * 7


def test_step_table_arithmetic():
    """Two steps of four kernels (one idle microsecond stretch each), 1 ms of wall time a step."""
    step = [("gemm_a", 0, 300), ("flash_fwd", 300, 200), ("ArgMaxOps", 500, 100), ("triton_poi_fused", 600, 100)]
    kernels = step + [(n, s + 1000, d) for n, s, d in step]
    t = profile_generate.step_table(kernels, 2, wall_s=0.002, timed_s=0.004, slots=64, weight_bytes=3 * 10**9,
                                    kv_bytes=10**9, peak_gbs=4000)
    assert t["kernels_per_step"] == 4 and t["steps"] == 2
    assert t["ms_per_step"] == pytest.approx({"attention": 0.2, "matmul": 0.3, "sampling": 0.1, "other": 0.1})
    assert t["device_ms_per_step"] == pytest.approx(0.7) and t["busy_ms_per_step"] == pytest.approx(0.7)
    assert t["wall_ms_per_step"] == pytest.approx(1.0) and t["host_gap_ms_per_step"] == pytest.approx(0.3)
    assert sum(t["share_of_wall"].values()) == pytest.approx(1.0) and t["share_of_wall"]["host_gap"] == pytest.approx(0.3)
    assert t["timed_ms_per_step"] == pytest.approx(2.0) and t["new_tok_per_s"] == pytest.approx(32000)
    assert t["bytes_per_step"]["total"] == 4 * 10**9 and t["hbm_gb_per_s"] == pytest.approx(2000)  # 4 GB / 2 ms
    assert t["bound"]["ms_per_step"] == pytest.approx(1.0) and t["bound"]["fraction_of_bound"] == pytest.approx(0.5)
    assert t["bound"]["new_tok_per_s"] == pytest.approx(64000)


def test_cpu_smoke_run_fills_the_table(tmp_path):
    """The tiny preset on CPU (dense attention): every field present, the split of the profiled
    wall time adds up, and the K/V read is 4 slots x the 64-position cache (24 prompt + 19 new
    tokens, in 64s) x 2 (K, V) x 6 layers x 2 kv heads x 16 dims x 4 bytes."""
    out = tmp_path / "p.json"
    t = profile_generate.main(["preset:tiny", "--slots", "4", "--prompt-len", "24", "--warmup", "2", "--steps", "3",
                               "--device", "cpu", "--threads", "1", "--out", str(out)])
    assert out.exists() and t["config"]["attention"] == "dense" and t["profiled"] == "as run"
    assert t["config"]["gqa_folded"] is True  # dense always folds
    assert t["kernels_per_step"] > 100 and t["busy_ms_per_step"] == pytest.approx(t["device_ms_per_step"])
    assert set(t["share_of_wall"]) == {"attention", "matmul", "sampling", "other", "host_gap"}
    assert sum(t["share_of_wall"].values()) == pytest.approx(1.0)
    assert all(t["ms_per_step"][c] > 0 for c in ("attention", "matmul", "sampling", "other"))
    assert t["bytes_per_step"]["kv"] == 4 * 64 * 2 * 6 * 2 * 16 * 4
    assert t["context_positions_mid"] == 24 + 2 + 3 + 1  # prompt, warm-up, timed run, half the profiled
    assert "bound" not in t and t["new_tok_per_s"] > 0
    # prefill chunks: the engine's 16,384-token budget caps rows at the 4 slots; then one row
    assert [(c["rows"], c["width"]) for c in t["prefill"]] == [(4, 24), (1, 24)]
    assert all(0 < c["host_ms"] <= c["wall_ms"] and c["first_ms"] > 0 for c in t["prefill"])
    assert all(c["tok_per_s"] == pytest.approx(c["rows"] * c["width"] / (c["wall_ms"] / 1e3), rel=1e-2) for c in t["prefill"])


def test_weight_bytes_leave_out_an_untied_input_embedding():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)
    tied = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    untied = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    every = sum(p.numel() * 4 for p in tied.parameters())  # fp32; the tied matrix counted once
    assert profile_generate.weight_bytes(tied) == every
    assert profile_generate.weight_bytes(untied) == every  # + the LM head, - the embedding: the same size
    assert sum(p.numel() * 4 for p in untied.parameters()) == every + 100 * 16 * 4


def _filled_tokens(share: float):
    """The tiny preset's engine on CPU, filled with `share` of 4 slots sampling, after 6 steps:
    (slots that sample, tokens each slot wrote)."""
    import torch

    args = profile_generate.parse_args(["preset:tiny", "--slots", "4", "--prompt-len", "24", "--warmup", "2",
                                        "--steps", "2", "--device", "cpu", "--sampled-share", str(share)])
    torch.manual_seed(0)  # random weights: the same model for every share
    engine = profile_generate.build(args, torch.device("cpu"))
    sampled = profile_generate.fill(engine, args.prompt_len, engine.max_new_tokens, engine.decoder.embed_w.shape[0],
                                    args.sampled_share)
    profile_generate.decode(engine, 6)
    table = engine.table
    assert sampled == len(engine._sampling)
    return sorted(engine._sampling), [table.tokens[s, : table.count[s]].tolist() for s in range(4)]


def test_sampled_share_makes_that_many_slots_sample_and_leaves_the_others_greedy():
    """Half the slots sample (the user turns' sampling, from GenerateConfig): the greedy slots
    write exactly the all-greedy run's tokens, the sampling ones write other tokens."""
    assert profile_generate.USER_TURN_SAMPLING.temperature > 0 and profile_generate.USER_TURN_SAMPLING.top_p < 1
    none, greedy = _filled_tokens(0.0)
    sampling, mixed = _filled_tokens(0.5)
    assert none == [] and len(sampling) == 2
    assert all(len(t) == 7 for t in greedy)  # the prefill's token, then 6 steps
    assert all(mixed[s] == greedy[s] for s in range(4) if s not in sampling)
    assert all(mixed[s] != greedy[s] for s in sampling)


def test_prefill_shapes_outside_the_engine_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_generate.main(["preset:tiny", "--slots", "4", "--prefill-shapes", "8x16", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--prefill-shapes 8x16: rows must be in [1, --slots]" in capsys.readouterr().err


def test_sampled_share_outside_0_1_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_generate.main(["preset:tiny", "--sampled-share", "1.5", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--sampled-share must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_weight_bytes_of_a_mixture_count_the_experts_some_slot_is_routed_to():
    """8 experts, 2 a token: one slot reads 2/8 of the experts' bytes, 4 slots 1 - (3/4)^4 of them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=4, tie_word_embeddings=True))
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    assert experts == 2 * 8 * 3 * 16 * 4 * 4  # layers x experts x (gate, up, down) x hidden x inter x fp32
    assert profile_generate.weight_bytes(model, 1) == rest + round(experts * 2 / 8)
    assert profile_generate.weight_bytes(model, 4) == rest + round(experts * (1 - 0.75 ** 4))


def test_the_bound_takes_the_bandwidth_of_the_gpu_it_runs_on():
    peak = profile_generate.peak_gbs_of
    assert peak("NVIDIA H200") == 4800.0 and peak("NVIDIA H100 80GB HBM3") == 3350.0
    assert peak("NVIDIA H100 PCIe") == 2000.0 and peak("NVIDIA H100 NVL") == 3900.0
    assert peak("NVIDIA A100-SXM4-80GB") == 2039.0 and peak("NVIDIA A100-SXM4-40GB") == 1555.0
    assert peak("NVIDIA GH200 480GB") == 4000.0 and peak("NVIDIA L40S") == 864.0
    assert peak("NVIDIA GeForce RTX 4090") is None


def test_a_hybrids_step_reads_its_attention_layers_cache_and_its_linear_states(tmp_path):
    """A hybrid's decode step reads the KV cache of its one attention layer and reads and writes
    each of its three linear-attention layers' float32 states: 4 slots x [4 value heads, 16 x 16]."""
    t = profile_generate.main(["preset:tiny-qwen3.5", "--slots", "4", "--prompt-len", "24", "--warmup", "2",
                               "--steps", "3", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "p.json")])
    assert t["bytes_per_step"]["kv"] == 4 * 64 * 2 * 1 * 2 * 16 * 4 + 2 * 3 * 4 * 4 * 16 * 16 * 4
    assert t["new_tok_per_s"] > 0
