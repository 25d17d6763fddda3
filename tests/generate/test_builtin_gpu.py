"""The built-in engine's CUDA path, which the CPU tests cannot reach: pinned host buffers read
one step late, CUDA events, CUDA-graphed decode steps per bucket, compiled flex decoding. Token
for token Hugging Face greedy on the same GPU, in fp32, with rows that stop on their first
token, short limits and slots refilled under a step in flight. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate.builtin import BuiltinEngine
from dflash_train.generate.engine import Request

from .test_builtin_engine import NEW, run_engine
from tests.families import build_model
from .tiny import make_model

HYBRIDS = ["qwen3_next", "qwen3_5"]  # linear attention from per-slot states, gated attention from the cache
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf_greedy_on_device(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_gpu
@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("attention,compile", [("dense", False), ("flex", True)])
def test_gpu_engine_equals_hf_greedy_with_stops_limits_and_refills(attention, compile, slots):
    model = make_model("llama", vocab=256, seed=1).cuda()
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in torch.randint(1, 24, (12,), generator=gen)]
    full = [hf_greedy_on_device(model, p) for p in prompts]
    stops = {full[1][0], full[2][0]}
    limits = [1, 2, 3, NEW, 1, 5, NEW, 2, NEW, 4, NEW, 7]
    expected = []
    for f, limit in zip(full, limits):
        cut = next((i for i, t in enumerate(f) if t in stops), NEW)
        expected.append((f[:cut], "stop") if cut < limit else (f[:limit], "length"))
    engine = BuiltinEngine(model, None, slots=slots, max_prompt_tokens=32, max_new_tokens=NEW, stop_ids=stops,
                           attention=attention, compile=compile, cuda_graphs=True)
    for _ in range(2):  # the second run replays the graphs captured by the first
        results = run_engine(engine, [Request(prompt_ids=p, max_new_tokens=n, tag=i)
                                      for i, (p, n) in enumerate(zip(prompts, limits))])
        assert [(results[i].token_ids, results[i].finish_reason) for i in range(len(prompts))] == expected
        assert engine.table.n_active == 0 and engine.stats.decode_steps > 0
    assert engine.stats.prefill_seconds > 0  # CUDA events timed the prefills


@needs_gpu
@pytest.mark.parametrize("attention,compile", [("dense", False), ("flex", True)])
@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gpt_oss", "mixtral", "phi3_window", *HYBRIDS])
def test_gpu_engine_on_windowed_and_hybrid_families_equals_hf_greedy(name, attention, compile):
    """Gemma 2 (capped scores and logits), Gemma 3, gpt-oss (sinks, experts), Mixtral (experts) and
    Phi-3 (fused projections, RoPE over half a head) on the CUDA path:
    prompts past the window, so the sliding-window layers decode from their rings (dense: W + 2
    keys, flex: one 128-key block in a 256-key cache), with flex compiled; and the hybrids Qwen3-Next
    and Qwen3.5, prefilled through the chunked delta rule, their linear-attention catch-up inside each
    decode step. CUDA-graphed where the decoder can be captured (experts in float32 go through
    PyTorch's host-side grouped GEMM fallback: eager, the test below graphs them in bfloat16)."""
    model = build_model(name, 300).cuda()
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (150, 9, 170, 131)]
    expected = [hf_greedy_on_device(model, p) for p in prompts]
    engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=200, max_new_tokens=NEW, stop_ids=set(),
                           attention=attention, compile=compile, cuda_graphs=True)
    assert engine.attention == attention
    assert name in HYBRIDS or min(engine.decoder.cache_lens) < engine.decoder.max_len
    assert engine.step.use_graphs == (name not in ("gpt_oss", "mixtral", "qwen3_next"))
    results = run_engine(engine, [Request(prompt_ids=p, max_new_tokens=NEW, tag=i) for i, p in enumerate(prompts)])
    assert [results[i].token_ids for i in range(len(prompts))] == expected


@needs_gpu
@pytest.mark.parametrize("attention", ["dense", "flex"])
@pytest.mark.parametrize("name", ["gpt_oss", "glm4_moe", "mixtral", "minimax_m2", "deepseek_v3", "glm4_moe_lite",
                                  "qwen3_5_moe"])
def test_gpu_engine_graphs_the_experts_in_bfloat16_as_eager_runs_them(name, attention):
    """gpt-oss, GLM-4.5 (a sigmoid router choosing within groups), Mixtral, MiniMax-M2, and DeepSeek-V3
    and GLM-4.7-Flash (latent attention from the cached latent) in bfloat16 on a Hopper GPU: the
    experts' grouped GEMM keeps its offsets on the device, so the decode step is captured, and its
    replays give the eager step's tokens."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PyTorch's bfloat16 grouped GEMM kernel needs a Hopper or newer GPU")
    model = build_model(name, 300).cuda().to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (150, 9, 170, 131)]
    tokens = {}
    for graphs in (False, True):
        engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=200, max_new_tokens=NEW, stop_ids=set(),
                               attention=attention, compile=False, cuda_graphs=graphs)
        assert engine.step.use_graphs == graphs
        results = run_engine(engine, [Request(prompt_ids=p, max_new_tokens=NEW, tag=i) for i, p in enumerate(prompts)])
        assert engine.step.use_graphs == graphs  # no capture fell back to eager
        tokens[graphs] = [results[i].token_ids for i in range(len(prompts))]
    assert tokens[True] == tokens[False]
