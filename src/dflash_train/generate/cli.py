"""Write training data with the target model itself.

    dflash-train generate --target builtin --prompts data/chats.jsonl --output gen.jsonl
    dflash-train generate --synthesize 10000 --output synth.jsonl --temperature 0.7
    dflash-train generate --engine http --base-url http://localhost:8000/v1 --prompts p.jsonl --output gen.jsonl
    dflash-train generate --prompts data/ --output gen.jsonl --max-minutes 30 --progress false

SIGINT/SIGTERM or --max-minutes end a run cleanly: no new prompt is taken, the conversations
started finish (every turn) and are written, the summary (with `stopped_by`) is printed and the exit code is 0.
A second Ctrl-C stops at once (exit 130); finished rows are kept either way.

Every field below is an option, spelled `--max_new_tokens` or `--max-new-tokens`;
`--config run.yaml` reads them from a file (options override it). Rerunning a command
resumes it. See docs/generate.md.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.http_engine import HttpEngineError
from dflash_train.generate.job import run_generate
from dflash_train.utils.command import program

log = logging.getLogger(__name__)

CONFIG = GenerateConfig
RESUME_HINT = "finished rows are saved; rerun the same command to resume"


def run(cfg: GenerateConfig, args: argparse.Namespace | None = None) -> int:
    try:
        summary = run_generate(cfg)
    except (KeyboardInterrupt, HttpEngineError):
        log.warning("%s", _after_a_failure(cfg.output))
        raise
    print(json.dumps(summary, indent=2) if cfg.summary == "json" else "\n".join(summary_lines(summary, cfg)))
    if summary.get("stopped_by") and cfg.summary == "json":  # a clean early stop: exit 0, resumable
        log.info("stopped early (%s); %s", summary["stopped_by"], RESUME_HINT)
    return 0


def _after_a_failure(output: str) -> str:
    """What a stopped run left: finished rows to resume from, or nothing at all."""
    path = Path(output)
    if path.is_file() and path.stat().st_size:
        return RESUME_HINT
    return f"no row was written to {output} (nothing to resume)"


def summary_lines(summary: dict, cfg: GenerateConfig) -> list[str]:
    """The run's summary in a few lines (--summary json prints every counter)."""
    s = summary
    lines = [f"wrote {s['written']:,} conversations to {s['output']} ({s['already_done']:,} there before), "
             f"{s['new_tokens']:,} new tokens in {s['seconds']:,.1f} s: {s['new_tokens_per_second']:,.0f} new tok/s, "
             f"{s['kept_tokens_per_second']:,.0f} kept"]
    skipped = {"errors": s["skipped_errors"], "plain-text rows": s["skipped_plain_text_rows"],
               "malformed rows": s["skipped_bad_rows"]}
    if any(skipped.values()):
        lines.append("skipped: " + ", ".join(f"{n:,} {what}" for what, n in skipped.items() if n))
    if s["synthetic_attempts"]:
        rejected = ", ".join(f"{n:,} {why}" for why, n in s["rejected_prompts"].items()) or "none"
        lines.append(f"synthetic user turns: {s['synthetic_attempts']:,} attempts, rejected: {rejected}")
    engine = s.get("engine_stats") or {}
    if engine.get("ms_per_decode_step") is not None:
        busy = f", {engine['slot_utilisation']:.0%} of the slots busy" if "slot_utilisation" in engine else ""
        lines.append(f"engine: {engine['ms_per_decode_step']:.1f} ms per decode step{busy} "
                     f"(--summary json: every counter)")
    if s.get("stopped_by"):
        lines.append(f"stopped by {s['stopped_by']}: {RESUME_HINT}")
    lines.append(f"next: {program()} prepare {s['output']} --target {cfg.target} --output DATA_DIR")
    return lines
