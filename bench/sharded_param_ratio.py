"""Parameter bytes each rank of a target group holds, over the whole model's (pipeline.target_group_size).

Saves a random dense (Qwen3) and a random MoE (Qwen3-MoE) target as safetensors model
directories, then starts G gloo processes on the CPU (torchrun) that each load their shard
of them as training does (target/sharded.py: meta-device build, FSDP2, each rank reading only
its rows) and run a forward; prints per rank the parameter bytes held and the bytes read from
the files, each over the whole model's, and the largest ratio of each model (the registry's
`sharded.cpu_param_bytes_ratio_g4` is the dense model's at G = 4; 1/G is the ideal).

    PYTHONPATH=src .venv/bin/python bench/sharded_param_ratio.py            # G = 4, ~30 s on 2 cores
    PYTHONPATH=src .venv/bin/python bench/sharded_param_ratio.py --group-size 2 --out ratio.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, vocab_size=16384, max_position_embeddings=1024, tie_word_embeddings=False)


def save_targets(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    configs = {"dense": Qwen3Config(**SHAPE),
               "moe": Qwen3MoeConfig(**SHAPE, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
                                     decoder_sparse_step=1, norm_topk_prob=True)}
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(str(root / name))
        out[name] = root / name
    return out


def worker(out: Path, targets: list[str]) -> None:
    import torch.distributed as dist

    from dflash_train.target import sharded
    from dflash_train.target.runner import TargetRunner

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    read = [0]
    rows = sharded.ShardReader.rows

    def counting(self, key, start, stop):
        t = rows(self, key, start, stop)
        read[0] += t.numel() * t.element_size()
        return t

    sharded.ShardReader.rows = counting
    report = {}
    for path in targets:
        read[0] = 0
        model = sharded.load_sharded_target(path, dtype=torch.bfloat16, device=torch.device("cpu"), group=group)
        runner = TargetRunner(model, [1, 4, 7], need_final=True)
        runner.run_documents(torch.randint(0, SHAPE["vocab_size"], (2, 32)), torch.tensor([32, 20]))
        local, whole = sharded.parameter_bytes(model)
        report[Path(path).name] = {"local": local, "whole": whole, "read": read[0]}
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--out", help="write the ratios as JSON here")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1:])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        targets = save_targets(root)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.group_size}",
               "--standalone", __file__, "--worker", str(root), *map(str, targets.values())]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        ranks = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(args.group_size)]
    result = {"group_size": args.group_size}
    print(f"G = {args.group_size} (ideal 1/G = {1 / args.group_size:.4f})")
    for name in targets:
        whole = ranks[0][name]["whole"]
        held = [r[name]["local"] / whole for r in ranks]
        read = [r[name]["read"] / whole for r in ranks]
        print(f"  {name:5s} {whole / 2**20:7.1f} MiB: held per rank {' '.join(f'{x:.4f}' for x in held)} | "
              f"read per rank {' '.join(f'{x:.4f}' for x in read)}")
        result[name] = {"whole_bytes": whole, "held_ratio": held, "read_ratio": read, "max_held_ratio": max(held)}
    print(f"sharded.cpu_param_bytes_ratio_g{args.group_size} {result['dense']['max_held_ratio']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
