"""How much the FP8 target forward perturbs what the drafter learns from (GPU).

Runs the same real token batches through the target in bf16 and with float8 decoder
matmuls (`target.fp8`), and reports the relative error of the tapped hidden states and
how often the greedy next token (the `target` label) changes.

    python bench/fp8_check.py --target builtin --data runs/smollm2/data --out fp8.json
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_train.data.batching import build_batch
from dflash_train.data.dataset import TokenDataset
from dflash_train.drafter.config import default_target_layer_ids
from dflash_train.target.loading import load_target_model
from dflash_train.target.runner import TargetRunner, find_decoder_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="builtin")
    ap.add_argument("--data", required=True, help="a prepared dataset to take real token sequences from")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--out", default="fp8_check.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    data = TokenDataset(args.data)
    batch = build_batch(data, [[i] for i in range(min(args.samples, len(data)))], epoch=0, index=0).to(dev)
    results = {}
    outs = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        model = load_target_model(args.target, dtype=torch.bfloat16, device=dev, fp8=fp8)
        taps_ids = default_target_layer_ids(len(find_decoder_layers(model)))
        runner = TargetRunner(model, taps_ids, need_final=True)
        out = runner(batch.input_ids, batch.position_ids, batch.document_ids)
        head = model.get_output_embeddings().weight
        greedy = (out.final_hidden @ head.T).argmax(-1)
        outs[name] = (out.taps.float(), greedy)
        torch.cuda.synchronize()
        runner.close()
        del model
    real = batch.document_ids >= 0
    (t16, g16), (t8, g8) = outs["bf16"], outs["fp8"]
    results["taps_rel_err"] = float((t8[real] - t16[real]).norm() / t16[real].norm())
    results["greedy_agreement"] = float((g8[real] == g16[real]).float().mean())
    results["tokens"] = int(real.sum())
    print(json.dumps(results, indent=1))
    json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
