"""`dflash-train eval --target PATH --drafter CKPT --prompts FILE|builtin|humaneval`.

Greedy speculative decoding of every prompt with KV caches for target and drafter, and
plain greedy decoding through the same code for comparison. Writes report.json and
report.png (see docs/eval.md) and prints the summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="builtin", help="model directory, .gguf file, or 'builtin' (default)")
    parser.add_argument("--drafter", required=True, type=Path,
                        help="exported drafter directory (or a training run / checkpoint directory)")
    parser.add_argument("--prompts", default="builtin",
                        help="'builtin' (= 'chat' = 'builtin:chat': held-out chat prompts), 'humaneval' "
                             "(= 'builtin:humaneval'), or a JSONL/JSON file")
    parser.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=4096, help="longer prompts are skipped")
    parser.add_argument("--no-greedy", action="store_true",
                        help="skip the plain greedy baseline (no speedup, no equality check; twice as fast)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 if any output differs from plain greedy decoding")
    parser.add_argument("--output", "-o", type=Path, default=None,
                        help="report directory (default runs/eval/<drafter>-<prompts>)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (default: the cores other processes leave idle)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def resolve_device_dtype(device: str, dtype: str):
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, getattr(torch, dtype)


def main(args: argparse.Namespace) -> int:
    from dflash_train.drafter.checkpoint import load_drafter
    from dflash_train.eval.prompts import PromptError, load_prompts, prompt_set_name
    from dflash_train.eval.report import plot_report, summary_lines, write_json
    from dflash_train.eval.run import EvalError, build_report, evaluate_prompts, make_proposer
    from dflash_train.target.loading import load_causal_lm, load_tokenizer, resolve_model_source
    from dflash_train.train.export_cli import find_drafter_dir

    if args.max_new_tokens < 1 or args.num_prompts < 0:
        print("error: --max-new-tokens must be >= 1 and --num-prompts >= 0", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.prompts, args.num_prompts or None)
        drafter_dir = find_drafter_dir(args.drafter)
        drafter = load_drafter(drafter_dir)
        source = resolve_model_source(args.target)
    except (PromptError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    if device.type == "cpu":
        from dflash_train.eval.run import choose_cpu_threads

        threads, why = choose_cpu_threads(args.threads)
        print(f"CPU threads: {threads} ({why})", file=sys.stderr)
    print(f"target {source.describe()} ({dtype}, {device}) | drafter {drafter_dir} (block "
          f"{drafter.config.block_size}) | {len(prompts)} prompts from {args.prompts}", file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(source, trust_remote_code=args.trust_remote_code)
    target = load_causal_lm(source, dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    try:
        proposer = make_proposer(drafter, target)
        results = evaluate_prompts(target, tokenizer, proposer, prompts, max_new_tokens=args.max_new_tokens,
                                   greedy=not args.no_greedy, max_prompt_tokens=args.max_prompt_tokens,
                                   progress=not args.no_progress)
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch
    import transformers

    report = build_report(results, proposer.block_size, target=source.describe(), drafter=str(drafter_dir),
                          prompts=args.prompts, max_new_tokens=args.max_new_tokens, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), torch=torch.__version__,
                          transformers=transformers.__version__)
    out = args.output or Path("runs/eval") / f"{drafter_dir.name}-{prompt_set_name(args.prompts)}"
    json_path = write_json(report, out / "report.json")
    png_path = plot_report(report, out / "report.png", title=f"{drafter_dir.name} on {prompt_set_name(args.prompts)}")
    print("\n".join(summary_lines(report)))
    print(f"report: {json_path}\nfigure: {png_path}")
    o = report["overall"]
    if "matches_greedy" in o and o["matches_greedy"] != o["prompts"]:
        hint = "" if dtype == torch.float32 else " (expected now and then in reduced precision: near-ties flip)"
        print(f"warning: {o['prompts'] - o['matches_greedy']} outputs differ from plain greedy decoding{hint}",
              file=sys.stderr)
        if args.strict:
            return 1
    return 0
