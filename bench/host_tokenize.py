"""What tokenising costs `generate`'s host thread: one prompt (or row) a call, against one call a batch.

    python bench/host_tokenize.py                                   # the built-in target's tokenizer, built-in chat prompts
    python bench/host_tokenize.py --target DIR --batch 192 --repeats 5 --out /tmp/ht.json

The built-in engine (generate/builtin.py) admits prompts into its free slots a few hundred at a
time (1,536 slots are refilled once 192 are free), rendering each one's chat template and
tokenising it, and detokenises the rows that finish at a step. That host thread also launches
every decode step, so its time counts whenever it is longer than the step in flight. This times
the engine's own `encode` one request at a time against `encode_many` on the whole batch, and the
tokenizer's `decode` of each finished row against the engine's `decode_rows` of them all,
checking that both ways give the same ids and texts. Prompts: `--prompts` (the built-in chat set by
default), cycled to fill `--batch`; the rows to detokenise are the prompts' own ids.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from dflash_train.data.prompts import load_prompts
from dflash_train.eval.report import write_json
from dflash_train.generate.builtin import BuiltinEngine, decode_rows
from dflash_train.generate.engine import Request
from dflash_train.target.loading import load_target_model, load_tokenizer


def measure(engine: BuiltinEngine, requests: list[Request], repeats: int) -> dict:
    """ms per request each way (the best of `repeats`), after checking both ways agree."""
    one_by_one = [engine.encode(r) for r in requests]
    batched = engine.encode_many(requests)
    if one_by_one != batched:
        raise AssertionError("encode_many differs from encode one request at a time")
    tok = engine.tokenizer
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    if [tok.decode(ids, **kw) for ids in batched] != decode_rows(tok, batched):
        raise AssertionError("decode_rows differs from decode one row at a time")

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times) / len(requests)

    out = {
        "encode_one_by_one_ms": best(lambda: [engine.encode(r) for r in requests]),
        "encode_batched_ms": best(lambda: engine.encode_many(requests)),
        "decode_one_by_one_ms": best(lambda: [tok.decode(ids, **kw) for ids in batched]),
        "decode_batched_ms": best(lambda: decode_rows(tok, batched)),
        "tokens_per_request": sum(map(len, batched)) / len(batched),
    }
    return {k: round(v, 4) for k, v in out.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="builtin", help="whose tokenizer: builtin or a model directory")
    p.add_argument("--prompts", default="chat", help="chat, humaneval or a prompt file")
    p.add_argument("--batch", type=int, default=192, help="requests tokenised together (an admission)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        p.error("--batch and --repeats must be >= 1")  # exit status 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.target)
    # a tiny random model: the engine is built only for its tokenising (no forward runs)
    engine = BuiltinEngine(load_target_model("preset:tiny", dtype=torch.float32, device=torch.device("cpu")),
                           tokenizer, slots=1, max_prompt_tokens=8, max_new_tokens=1, stop_ids=set(), ignore_eos=True)
    prompts = load_prompts(args.prompts)
    requests = [Request(messages=prompts[i % len(prompts)].messages) for i in range(args.batch)]
    result = measure(engine, requests, args.repeats)
    result["config"] = {"target": args.target, "prompts": args.prompts, "batch": args.batch, "repeats": args.repeats,
                        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                        "tokenizer": type(tokenizer).__name__}
    print(f"host_tokenize: {args.batch} requests of {args.prompts} ({result['tokens_per_request']:.0f} tokens each), "
          f"{type(tokenizer).__name__}, {os.cpu_count()} CPUs")
    print(f"encode  one by one {result['encode_one_by_one_ms']:.3f} ms a request, batched {result['encode_batched_ms']:.3f}")
    print(f"decode  one by one {result['decode_one_by_one_ms']:.3f} ms a row, batched {result['decode_batched_ms']:.3f}")
    if args.out:
        print(f"wrote {write_json(result, args.out)}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
