"""Set keys of bench/results/summary.json (the registry of headline numbers), or check it.

    python bench/results/update_summary.py KEY VALUE DEVICE "COMMAND" [KEY VALUE DEVICE "COMMAND" ...]
    python bench/results/update_summary.py --check

Each key maps to {"value", "device", "date", "command"}; the date is today's. Only numbers
that were measured go in. COMMAND is what a user runs from the repository root to measure the
number again; notes and the raw result's path follow as a shell comment (`cmd  # ...; raw:
bench/results/<folder>/<file>`). Every repository path a command names (bench/, dev/, tools/,
scripts/, configs/, src/, docs/, tests/, .ci/; `*` globs) must exist: a command naming a missing script or
result is refused with exit status 2, and `--check` checks the whole registry.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

PATH = Path(__file__).with_name("summary.json")
ROOT = PATH.parents[2]
# a repository path: a known top folder, then path characters; trailing punctuation is prose
_PATH = re.compile(r"(?<![\w/.-])((?:bench|dev|tools|scripts|configs|src|docs|tests|\.ci)/[\w./*-]*[\w/*])")


def named_paths(command: str) -> list[str]:
    """The repository paths a command names, in order."""
    return _PATH.findall(command)


def missing_paths(command: str, root: Path | None = None) -> list[str]:
    """The named paths that match nothing under `root` (default: this repository; a `*` is a glob)."""
    root = root or ROOT
    return [p for p in named_paths(command) if not (any(root.glob(p)) if "*" in p else (root / p).exists())]


def check(data: dict, root: Path | None = None) -> list[str]:
    """One line per registry key whose command names a missing path."""
    return [f"{PATH.name}: key {key}: command names {p}, which does not exist"
            for key, entry in data.items() for p in missing_paths(entry.get("command", ""), root)]


def main(argv: list[str]) -> int:
    data = json.loads(PATH.read_text()) if PATH.exists() else {}
    if argv == ["--check"]:
        problems = check(data)
        print("\n".join(problems) or f"{PATH.name}: {len(data)} keys, every named path exists",
              file=sys.stderr if problems else sys.stdout)
        return 2 if problems else 0
    if not argv or len(argv) % 4:
        print(__doc__, file=sys.stderr)
        return 2
    today = datetime.date.today().isoformat()
    new = {}
    for i in range(0, len(argv), 4):
        key, value, device, command = argv[i:i + 4]
        new[key] = {"value": float(value), "device": device, "date": today, "command": command}
    problems = check(new)
    if problems:  # nothing written: the registry keeps only reproducible commands
        print("\n".join(problems), file=sys.stderr)
        return 2
    data.update(new)
    PATH.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
