"""Where a decode step of `generate` goes: kernels, device time, HBM bandwidth, host gaps.

    # on a GPU: the generate target's shape (SmolLM2-135M, random weights) at 1,536 slots
    python bench/profile_generate.py preset:smollm2-135m --slots 1536 --prompt-len 256 --out gen_smollm2.json
    # Qwen3-8B's shape at 256 slots, against the GPU's HBM bandwidth (4.8 TB/s on an H200)
    python bench/profile_generate.py preset:qwen3-8b --slots 256 --prompt-len 512 --out gen_qwen3_8b.json
    # CPU smoke check of the script itself (the table's plumbing, not a speed):
    python bench/profile_generate.py preset:tiny --slots 4 --prompt-len 24 --steps 4 --device cpu --out /tmp/p.json

The built-in engine (generate/builtin.py) exactly as `generate` runs it (CUDA graphs, compiled
layer functions and FlexAttention on a GPU; every slot busy; greedy, or with `--sampled-share`
that share of the slots sampling as `generate` samples self-instructed user turns (0.3 of the
slot-steps of the recipe's `--mix` runs while reruns repeated dropped attempts)) is filled with `--slots`
random prompts of `--prompt-len` tokens, decodes `--warmup` steps, then `--steps` more in its
own loop (one step launched ahead of the read-back), timed by the wall clock and then again
under torch.profiler. Reported per step:

* kernels and device time: CUDA kernels on a GPU; on CPU every aten op with its self time
  stands in for them (a smoke check of the table, not a profile);
* busy (the union of the kernels' intervals) and the host gap: wall time minus busy, what the
  device waits for the host (launches, the read-back, Python bookkeeping);
* the split of the wall time by kernel name: attention, matmuls, sampling (argmax, top-k/p,
  noise), other (norms, RoPE, copies, cache writes), host gap;
* bytes read from memory: every weight once (an untied input embedding only by its gathered rows,
  left out), plus the K/V the attention reads (dense: every
  slot up to the length bucket; flex: each slot's own 128-key blocks); over the wall time, the
  achieved GB/s; against `--peak-gbs`, the bound on ms per step and new tok/s.
Weights are random (time depends on shapes only).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_train.generate.attention import FLEX_BLOCK, folds_gqa
from dflash_train.generate.builtin import PREFILL_TOKENS, BuiltinEngine
from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.engine import Request
from dflash_train.generate.graphs import bucket_of
from dflash_train.generate.sampling import Sampling
from dflash_train.target.loading import load_target_model
from dflash_train.utils.device import sync

CATEGORIES = ("attention", "matmul", "sampling", "other")
_ATTENTION = ("attention", "flash", "fmha", "flex", "sdpa", "softmax")
_MATMUL = ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "cutlass", "xmma", "nvjet", "cublas", "splitk")
_SAMPLING = ("argmax", "topk", "sort", "gumbel", "multinomial", "cumsum")


def classify(name: str) -> str:
    """A kernel's (or CPU op's) category, by its name."""
    low = name.lower()
    if any(k in low for k in _SAMPLING):
        return "sampling"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _MATMUL):
        return "matmul"
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kv_read_bytes(positions: list[int], attention: str, bucket: int, per_position: int,
                  layers: Sequence[tuple[int | None, int | None]] = ((None, None),)) -> int:
    """K and V bytes one decode step's attention reads: `per_position` bytes (one layer, K and V) per
    cache position and layer of `layers` (each layer's sliding window and ring length, None for
    none). Dense reads every slot up to `bucket` (a ring: at most its length); flex reads each
    slot's own blocks, from the block holding the first key of its window (block 0 for a full
    layer) to its position's, and of a ring at most all of it."""
    if attention != "flex":
        return len(positions) * per_position * sum(min(bucket, ring or bucket) for _, ring in layers)
    blocks = 0
    for p in positions:
        for window, ring in layers:
            if ring:
                blocks += min(p // FLEX_BLOCK + 1, ring // FLEX_BLOCK)
            else:
                blocks += p // FLEX_BLOCK + 1 - (max(p - window + 1, 0) // FLEX_BLOCK if window else 0)
    return blocks * FLEX_BLOCK * per_position


def layer_caches(dec) -> list[tuple[int | None, int | None]]:
    """(sliding window, ring length or None) of each layer of the engine's decoder."""
    return [(lay.window, n if n < dec.max_len else None) for lay, n in zip(dec.layers, dec.cache_lens)]


def step_table(kernels: list[tuple[str, float, float]], steps: int, wall_s: float, timed_s: float, slots: int,
               weight_bytes: int, kv_bytes: int, peak_gbs: float | None) -> dict:
    """The per-step table from `kernels` (name, start us, duration us) of `steps` steps that took
    `wall_s` seconds (the split of the wall time) and `timed_s` without the profiler (speed and
    bandwidth); bytes read per step; the bound at `peak_gbs` (GB/s) if given."""
    wall_ms, timed_ms = 1000 * wall_s / steps, 1000 * timed_s / steps
    by_cat = {c: 0.0 for c in CATEGORIES}
    for name, _, dur in kernels:
        by_cat[classify(name)] += dur
    busy_ms = busy_us([(s, s + d) for _, s, d in kernels]) / 1000 / steps
    gap_ms = max(wall_ms - busy_ms, 0.0)
    ms = {c: v / 1000 / steps for c, v in by_cat.items()}
    step_bytes = weight_bytes + kv_bytes
    out = {
        "steps": steps, "slots": slots, "kernels_per_step": len(kernels) / steps,
        "device_ms_per_step": sum(ms.values()), "busy_ms_per_step": busy_ms, "wall_ms_per_step": wall_ms,
        "host_gap_ms_per_step": gap_ms, "ms_per_step": ms,
        "share_of_wall": {**{c: v / wall_ms for c, v in ms.items()}, "host_gap": gap_ms / wall_ms},
        "timed_ms_per_step": timed_ms, "new_tok_per_s": slots / (timed_ms / 1000),
        "bytes_per_step": {"weights": weight_bytes, "kv": kv_bytes, "total": step_bytes},
        "hbm_gb_per_s": step_bytes / (timed_ms / 1000) / 1e9,
        "hbm_gb_per_s_busy": step_bytes / (busy_ms / 1000) / 1e9 if busy_ms else None,
    }  # fmt: skip
    if peak_gbs:
        bound_ms = step_bytes / (peak_gbs * 1e9) * 1000
        out["bound"] = {"peak_gb_per_s": peak_gbs, "ms_per_step": bound_ms, "new_tok_per_s": slots / (bound_ms / 1000),
                        "fraction_of_bound": bound_ms / timed_ms}
    return out


def profiled_kernels(prof, cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every CUDA kernel; on CPU of every aten op with its self
    time (the time not spent in the aten ops it calls), laid end to end: on one thread the self
    times never overlap, so their union is their sum."""
    out, clock = [], 0.0
    for e in prof.events():
        if cuda:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
        elif e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            out.append((e.name, clock, e.self_cpu_time_total))
            clock += e.self_cpu_time_total
    return out


# Memory bandwidth of the GPUs the bound is asked of most, GB/s from their data sheets, the
# first name that occurs in torch's device name (more specific names first).
PEAK_GBS = (("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
            ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
            ("L40", 864.0), ("L4", 300.0))


def peak_gbs_of(device_name: str) -> float | None:
    """The bandwidth for the bound of a GPU named `device_name` (torch.cuda.get_device_name), None if unknown."""
    return next((gbs for name, gbs in PEAK_GBS if name in device_name), None)


def weight_bytes(model, slots: int = 1) -> int:
    """Bytes of weights a decode step reads: every parameter once (tied ones once), except an
    input embedding that is not also the LM head: a step gathers only one row of it per slot;
    and the experts of a mixture: only those some slot is routed to, 1 - (1 - k/E)^slots of
    them in expectation under uniform routing (all of them, nearly, at hundreds of slots)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is not None and head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    cfg = model.config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        hit = 1 - (1 - cfg.num_experts_per_tok / experts) ** slots
        expert_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                           if ".experts." in name)
        total -= round(expert_bytes * (1 - hit))
    return total


# how `generate` samples a self-instructed user turn, from its config's defaults
USER_TURN_SAMPLING = GenerateConfig(output="profile.jsonl", synthesize=1).prompt_sampling


def fill(engine: BuiltinEngine, prompt_len: int, max_new: int, vocab: int, sampled_share: float = 0.0) -> int:
    """Every slot admitted with a random prompt of `prompt_len` tokens (EOS ignored): the first
    round(sampled_share x slots) sample as user turns do, the rest are greedy. Returns that count."""
    g = torch.Generator().manual_seed(0)
    sampled = round(sampled_share * engine.slots)
    queue = [Request(prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), max_new_tokens=max_new,
                     sampling=USER_TURN_SAMPLING if i < sampled else Sampling(), key=i)
             for i in range(engine.slots)][::-1]  # popped from the end: request i goes in first
    engine._admit(lambda: queue.pop() if queue else None, _never_completes)
    if engine._n_active() != engine.slots:
        raise RuntimeError("not every slot took a prompt")
    return sampled


def _never_completes(request, completion) -> None:
    raise RuntimeError(f"a row finished during the profile ({completion.finish_reason}): raise --max-new-tokens")


def decode(engine: BuiltinEngine, steps: int) -> None:
    """`steps` decode steps in the engine's own order (BuiltinEngine.run): launch t, read t-1."""
    pending = None
    for _ in range(steps):
        launched = engine._launch()
        if pending is not None:
            engine._collect(pending, _never_completes)
        pending = launched
    engine._collect(pending, _never_completes)



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="preset:NAME (random weights) or a Hugging Face model directory")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of every slot's prompt")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before the measured ones")
    p.add_argument("--steps", type=int, default=20, help="measured (and profiled) decode steps")
    p.add_argument("--sampled-share", type=float, default=0.0,
                   help="share of the slots that sample as generate's self-instructed user turns do, the rest greedy")
    p.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="the device's memory bandwidth in GB/s for the bound (default: the data sheet's for a GPU "
                        "named in PEAK_GBS, e.g. 4800 for an H200, 3350 for an H100 SXM; else no bound)")
    p.add_argument("--prefill-shapes", nargs="*", default=None, metavar="ROWSxWIDTH",
                   help="prefill chunks timed after the decode steps (rows x tokens, at most --slots x --prompt-len; "
                        "default: the engine's 16,384-token chunks of 64 and of --prompt-len tokens a row, and one row)")
    p.add_argument("--prefill-reps", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not 0.0 <= args.sampled_share <= 1.0:
        p.error(f"--sampled-share must be in [0, 1], got {args.sampled_share}")  # exit status 2
    if args.prefill_shapes is None:
        widths = sorted({min(64, args.prompt_len), args.prompt_len})
        args.prefill_shapes = [f"{min(args.slots, max(1, PREFILL_TOKENS // w))}x{w}" for w in widths] + [f"1x{args.prompt_len}"]
    try:
        args.prefill_shapes = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.prefill_shapes]
    except ValueError:
        p.error(f"--prefill-shapes: ROWSxWIDTH, e.g. 128x128; got {args.prefill_shapes}")
    for rows, width in args.prefill_shapes:
        if not (1 <= rows <= args.slots and 1 <= width <= args.prompt_len):
            p.error(f"--prefill-shapes {rows}x{width}: rows must be in [1, --slots] and width in [1, --prompt-len]")
    return args


def build(args, device: torch.device) -> BuiltinEngine:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_target_model(args.target, dtype=dtype, device=device)
    max_new = args.warmup + 3 * args.steps + 8  # warm-up, timed run, profile and maybe its eager rerun
    return BuiltinEngine(model, None, slots=args.slots, max_prompt_tokens=args.prompt_len, max_new_tokens=max_new,
                         stop_ids=set(), ignore_eos=True, cuda_graphs=not args.no_cuda_graphs,
                         compile=not args.no_compile and device.type == "cuda", attention=args.attention)


def timed(engine: BuiltinEngine, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    decode(engine, steps)
    sync(device)
    return time.perf_counter() - t0


def profile_steps(engine: BuiltinEngine, steps: int, device: torch.device) -> tuple[list, float, str]:
    """(kernels, seconds, how) of `steps` profiled decode steps. Where the profiler sees no
    kernels inside the CUDA graph replays, the steps are profiled again without the graph
    (the same compiled kernels, each launched): their names and times are what the graph
    replays, only the host gaps of that run are not."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        seconds = timed(engine, steps, device)
    kernels, how = profiled_kernels(prof, cuda), "as run"
    if cuda and engine.step.use_graphs and len(kernels) < 10 * steps:
        engine.step.use_graphs = False
        try:
            with profile(activities=activities) as prof:
                seconds = timed(engine, steps, device)
        finally:
            engine.step.use_graphs = True
        kernels, how = profiled_kernels(prof, cuda), "without the CUDA graph (its kernels were not visible)"
    return kernels, seconds, how


def measure(engine: BuiltinEngine, args, device: torch.device) -> dict:
    """Fill, warm up, time, profile; the table of the profiled steps."""
    dec = engine.decoder
    sampled = fill(engine, args.prompt_len, engine.max_new_tokens, dec.embed_w.shape[0], args.sampled_share)
    decode(engine, args.warmup)
    start = engine.table.next_pos[engine.table.row >= 0].tolist()
    timed_s = timed(engine, args.steps, device)
    kernels, profiled_s, how = profile_steps(engine, args.steps, device)
    # The split uses the profiled run's own wall time on CPU (the profiler slows every op there);
    # on a GPU kernel times are the device's, so the clean run's wall time is the reference.
    wall_s = timed_s if device.type == "cuda" else profiled_s
    mid = [p + args.steps + args.steps // 2 for p in start]  # the profiled steps' middle position
    bucket = bucket_of(1 + max(mid), engine.buckets)
    per_position = 2 * dec.n_kv * dec.head_dim * dec.embed_w.element_size()  # one layer's K and V
    weights = weight_bytes(engine.model, engine.slots)
    peak = args.peak_gbs if args.peak_gbs is not None else \
        peak_gbs_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    # a hybrid's linear-attention layers read and write every slot's float32 state each step
    states = 2 * sum(t.numel() * t.element_size() for t in dec.states.states) if hasattr(dec, "states") else 0
    table = step_table(kernels, args.steps, wall_s, timed_s, engine.slots, weights,
                       kv_read_bytes(mid, engine.attention, bucket, per_position, layer_caches(dec)) + states, peak)
    names: dict[str, list[float]] = {}
    for name, _, dur in kernels:
        names.setdefault(name, []).append(dur)
    table["top_kernels"] = [(n[:100], classify(n), round(len(d) / args.steps, 1), round(sum(d) / args.steps, 1))
                            for n, d in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:15]]
    table["context_positions_mid"] = round(sum(mid) / len(mid), 1)
    table["profiled"] = how
    table["sampled_slots"] = sampled
    return table


def prefill_times(engine: BuiltinEngine, shapes: list[tuple[int, int]], reps: int, device: torch.device) -> list[dict]:
    """Each prefill chunk shape, `reps` times as the engine runs it (a right-padded [rows, width]
    chunk into the first `rows` slots, padded to its bucket shape: a captured step on CUDA, eager
    without CUDA graphs): wall ms a chunk, and the host's ms issuing it (what the host thread
    cannot spend launching decode steps), and the first call's ms (a new shape's capture: its
    warm-up runs and, for cuDNN attention, the plan of a new shape). Each call starts on an idle
    device and is timed alone,
    so the host's time is the issue time (back to back, the launch queue fills and the host
    waits for the device: host = wall whatever bounds it). Run after the decode steps: it
    overwrites those slots' caches."""
    out = []
    for rows, width in shapes:
        padded = engine.prefill.shapes.shape(rows, width)
        slot_idx, lengths, ids = engine.prefill.shapes.views(engine.prefill.buffer, padded)
        slot_idx.copy_(torch.arange(len(slot_idx), device=device))
        lengths.fill_(width)
        ids.copy_(torch.randint(0, engine.decoder.embed_w.shape[0], ids.shape, device=device))
        host = wall = 0.0
        with torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            engine.prefill_step(padded)  # the first call: the capture of a new shape, the allocator
            sync(device)
            first = time.perf_counter() - t0
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                engine.prefill_step(padded)
                host += time.perf_counter() - t0
                sync(device)
                wall += time.perf_counter() - t0
        out.append({"rows": rows, "width": width, "padded": list(padded), "first_ms": round(1e3 * first, 3),
                    "wall_ms": round(1e3 * wall / reps, 3),
                    "host_ms": round(1e3 * host / reps, 3), "tok_per_s": round(rows * width * reps / wall, 1)})
    return out


def report(t: dict) -> None:
    rows = [("new tok/s", f"{t['new_tok_per_s']:.1f}"),
            ("ms / step", f"{t['timed_ms_per_step']:.3f}; profiled {t['wall_ms_per_step']:.3f} (busy "
                          f"{t['busy_ms_per_step']:.3f}, host gap {t['host_gap_ms_per_step']:.3f}; {t['profiled']})"),
            ("kernels / step", f"{t['kernels_per_step']:.1f}, {t['device_ms_per_step']:.3f} ms of device time"),
            ("share of wall", ", ".join(f"{k} {v:.1%}" for k, v in t["share_of_wall"].items())),
            ("bytes / step", f"weights {t['bytes_per_step']['weights'] / 1e9:.3f} GB + "
                             f"KV {t['bytes_per_step']['kv'] / 1e9:.3f} GB"),
            ("HBM", f"{t['hbm_gb_per_s']:.1f} GB/s over the wall time")]
    if "bound" in t:
        b = t["bound"]
        rows.append(("bound", f"{b['ms_per_step']:.3f} ms/step = {b['new_tok_per_s']:.0f} new tok/s at "
                              f"{b['peak_gb_per_s']:.0f} GB/s; measured {b['fraction_of_bound']:.1%} of it"))
    width = max(len(a) for a, _ in rows)
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    for name, cat, count, us in t["top_kernels"][:8]:
        print(f"  {us:10.1f} us  {count:6.1f} x  {cat:<9}  {name}")
    for c in t.get("prefill", []):
        print(f"prefill {c['rows']} x {c['width']} (as {c['padded'][0]} x {c['padded'][1]}): {c['wall_ms']:.3f} ms a chunk "
              f"(host {c['host_ms']:.3f} ms; the first call {c['first_ms']:.1f} ms), "
              f"{c['tok_per_s']:.0f} prompt tok/s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build(args, device)
    # the query layout the attention kernel gets (flex: folded GQA lets the compiler take its decoding kernel)
    folded = folds_gqa(engine.attention, engine.slots, engine.decoder.n_kv, device)
    print(f"profile_generate: {args.target}, {args.slots} slots ({args.sampled_share:.0%} sampling), "
          f"prompts of {args.prompt_len} tokens, {engine.attention} attention (GQA {'folded' if folded else 'native'}), "
          f"{'CUDA graphs' if engine.step.use_graphs else 'eager'}, {device}", flush=True)
    table = measure(engine, args, device)
    table["prefill"] = prefill_times(engine, args.prefill_shapes, args.prefill_reps, device)
    table["config"] = {"target": args.target, "slots": args.slots, "sampled_share": args.sampled_share,
                       "prompt_len": args.prompt_len, "steps": args.steps,
                       "attention": engine.attention, "gqa_folded": folded,
                       "cuda_graphs": engine.step.use_graphs, "device": str(device),
                       "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                       "torch": torch.__version__}
    report(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table, indent=2) + "\n")
        print(f"wrote {args.out}")
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
