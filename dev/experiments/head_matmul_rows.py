"""The LM head's matmuls at the qwen3-8b bench shape against the number of rows: a chunk of the
drafter's head (4096, 4095 = 273 blocks of 15 slots, 4080) and the target labels' head (its row
count is the number of distinct label positions, ~4,480, any parity). Forward logits h @ W.T and
the gradient's g @ W, bf16, CUDA events, median of `--iters`.

    python dev/experiments/head_matmul_rows.py --out head_matmul_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from drafter_flex_vs_dense import timed  # noqa: E402 -- the benches' median of CUDA-event timings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, nargs="*", default=[4096, 4095, 4080, 3584, 3585, 3600, 4480, 4481, 4479, 4483])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="head_matmul_rows.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = {}
    for m in args.rows:
        h = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        grad = torch.randn(m, args.vocab, device="cuda", dtype=torch.bfloat16, generator=g)
        fwd = timed(lambda: h @ w.T, device, repeat=args.iters, warmup=2)
        back = timed(lambda: grad @ w, device, repeat=args.iters, warmup=2)
        tflop = 2 * m * args.hidden * args.vocab / 1e12
        rows[m] = {"logits_ms": fwd, "grad_ms": back, "logits_tflops": tflop / fwd * 1e3, "grad_tflops": tflop / back * 1e3}
        print(f"rows {m:6d}  logits {fwd:7.3f} ms ({rows[m]['logits_tflops']:5.0f} TFLOP/s)  "
              f"grad {back:7.3f} ms ({rows[m]['grad_tflops']:5.0f} TFLOP/s)", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
