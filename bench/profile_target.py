"""Where the target forward's time goes: one setting of the `target:` levers, kernel by kernel.

Builds a preset target (random weights), runs its tapped forward on one packed row of
`--tokens` tokens (one document) as training does, and prints the median forward time and
the top CUDA kernels (torch.profiler) grouped by name. Settings are `target:` config keys; without
them, the Hugging Face forward, uncompiled.

    python bench/profile_target.py --preset qwen3-8b --set forward=packed compile=true sdpa_backend=cudnn
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_train.data.batch import pack_documents
from dflash_train.drafter.config import default_target_layer_ids
from dflash_train.target.config import TargetConfig
from dflash_train.target.loading import load_target_model
from dflash_train.target.runner import TargetRunner, find_decoder_layers
from dflash_train.utils.config import load_config
from dflash_train.utils.device import resolve_device, resolve_dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--need-final", action=argparse.BooleanOptionalAction, default=True,
                    help="target labels (the whole forward + final norm); --no-need-final: data labels")
    ap.add_argument("--set", nargs="*", default=[], help="target config KEY=VALUE (forward, compile, sdpa_backend, fp8, grouped_kv)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the Hugging Face forward, uncompiled, unless --set says otherwise (not `auto`: a lever is measured alone)
    cfg = load_config(TargetConfig, None, {"path": f"preset:{args.preset}", "forward": "hf", "compile": "false",
                                           **dict(kv.split("=", 1) for kv in args.set)})
    device = resolve_device(args.device)
    model = load_target_model(cfg.path, dtype=resolve_dtype(cfg.dtype, device), device=device, fp8=cfg.fp8)
    runner = TargetRunner.from_config(model, default_target_layer_ids(len(find_decoder_layers(model))), cfg,
                                      need_final=args.need_final)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    batch = pack_documents([(0, ids, torch.ones(args.tokens, dtype=torch.bool))], [[0]])
    if device.type == "cuda":
        batch = batch.pin_memory()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    runner.run_batch(batch, device)  # compiles in compiled mode
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        runner.run_batch(batch, device)
        sync()
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1000
    result = {"preset": args.preset, "tokens": args.tokens, "settings": {k: getattr(cfg, k, None) for k in
              ("forward", "compile", "sdpa_backend", "fp8", "grouped_kv")}, "need_final": args.need_final,
              "forward_ms_median": ms, "first_call_s": first,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    print(json.dumps(result))
    if device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            runner.run_batch(batch, device)
            sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70)
        print(table)
        result["kernels"] = table
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
