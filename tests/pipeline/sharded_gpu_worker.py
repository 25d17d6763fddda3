"""One process of tests/pipeline/test_sharded_target_gpu.py: the `tiny` preset sharded with FSDP2
over this process's NCCL group (every GPU torchrun gives it), its packed forward compiled,
gathering each layer itself on the GPU's streams, against the same compiled forward of the preset
built whole. Prints one JSON line from rank 0: the largest difference of the taps and of the final
norm, over rows of several documents and rows of one."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from dflash_train.target import sharded
from dflash_train.target.presets import build_random_target
from dflash_train.target.runner import TargetRunner
from sharded_worker import packed_rows  # this script's folder is on the path: the CPU worker's rows


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(dist.get_world_size())))
    model = sharded.load_sharded_target("preset:tiny", dtype=torch.bfloat16, device=device, group=group)
    whole = build_random_target("preset:tiny", dtype=torch.bfloat16, device=device)
    taps = [1, 3, 5]
    ours = TargetRunner(model, taps, need_final=True, forward="packed", compile=True)
    ref = TargetRunner(whole, taps, need_final=True, forward="packed", compile=True)
    gen = torch.Generator().manual_seed(rank)
    diffs = []
    for layout in ([[100, 57, 99], [200, 56]], [[256], [190]]):
        batch = [t.cuda() for t in packed_rows(layout, 256, 512, gen)]
        for _ in range(2):  # the second call runs the compiled code
            a, b = ours(*batch), ref(*batch)
        diffs.append([float((a.taps - b.taps).abs().max()), float((a.final_hidden - b.final_hidden).abs().max())])
    held = sharded.parameter_bytes(model)
    if rank == 0:
        print(json.dumps({"diffs": diffs, "held": held[0] / held[1], "world": dist.get_world_size()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
