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

from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.http_engine import HttpEngineError
from dflash_train.generate.tasks import run_generate

log = logging.getLogger(__name__)

CONFIG = GenerateConfig
RESUME_HINT = "finished rows are saved; rerun the same command to resume"


def run(cfg: GenerateConfig, args: argparse.Namespace | None = None) -> int:
    try:
        summary = run_generate(cfg)
    except KeyboardInterrupt:
        log.warning("interrupted; %s", RESUME_HINT)
        raise
    except HttpEngineError:
        log.warning(RESUME_HINT)
        raise
    print(json.dumps(summary, indent=2))
    if summary.get("stopped_by"):  # a clean early stop (signal or --max-minutes): exit 0, resumable
        log.info("stopped early (%s); %s", summary["stopped_by"], RESUME_HINT)
    return 0
