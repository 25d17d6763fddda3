"""Build training prompt files from offline sources (the target writes every answer later).

    dflash-train prompts --output runs/prompts --seed 0 --shards 2
    dflash-train prompts --sources stdlib-code math --limit 5000 --output runs/prompts
    dflash-train prompts --check runs/gen/synth.jsonl        # HumanEval guard only

Writes train/<source>.jsonl (or <source>-<k>of<N>.jsonl with --shards N), heldout/<source>-heldout.jsonl
and manifest.json (counts, files and their sha256, licences). Stops with an error, writing
nothing, if a prompt near-duplicates a HumanEval prompt or solution. Rerunning with the same
options keeps the output. See docs/recipe-smollm2.md.
"""

from __future__ import annotations

import argparse

from dflash_train.data.prompt_sources.build import build, check_files, stdlib_directory
from dflash_train.data.prompt_sources.config import PromptsConfig
from dflash_train.data.prompt_sources.guard import HumanEvalGuard

CONFIG = PromptsConfig


def run(cfg: PromptsConfig, args: argparse.Namespace | None = None) -> int:
    if not cfg.check:
        stdlib_directory(cfg)  # the user's own paths first, then what the machine lacks
    guard = HumanEvalGuard.humaneval(cfg.humaneval_file, threshold=cfg.humaneval_threshold)
    if cfg.check:
        rows = check_files(cfg.check, guard)
        print(f"HumanEval guard: {rows:,} rows of {len(cfg.check)} file(s) checked, no near-duplicate "
              f"(overlap coefficient of word 3-grams < {cfg.humaneval_threshold})")
        return 0
    manifest, written = build(cfg, guard)
    print(f"{'wrote' if written else 'up to date (same options):'} {cfg.output}")
    print(f"{'source':<14} {'candidates':>10} {'exact dup':>9} {'near dup':>8} {'train':>8} {'heldout':>7} "
          f"{'(groups)':>8} {'dropped':>7}")
    for name, s in manifest["sources"].items():
        print(f"{name:<14} {s['candidates']:>10,} {s['exact_duplicates']:>9,} {s['near_duplicates']:>8,} "
              f"{s['train']:>8,} {s['heldout']:>7,} {s['heldout_groups']:>8,} {s['heldout_dropped']:>7,}")
    print("near dup: of an earlier source's prompt; dropped: held-out prompts that near-duplicate a training prompt")
    return 0
