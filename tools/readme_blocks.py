"""Every ```bash block of README.md pasted into a fresh bash, as a newcomer would: exit status and time.

    python tools/readme_blocks.py --out readme_blocks.json      # from the root of a fresh clone

Each block runs once, in order, in the repository root, under `bash -e` with a new shell's
environment (PATH=/usr/bin:/bin, HOME and the machine's pip settings, nothing else), so a command that only works from an
activated virtual environment fails here as it would there. The marks are tests/test_readme.py's:
blocks marked `skip` there (they install packages and run for minutes) run here, since a newcomer
pastes them too; blocks marked `check-only` name GPUs and model folders this machine may not have:
they are listed as not run (the test checks their options and paths); any other mark is an error. The blocks
install packages and train; on 2 CPU cores they take about 45 minutes in all (README.md, "Run
times"). Exit status 1 when a run block fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[a-z-]+) \((?P<why>[^)]+)\) -->\n)?```bash\n(?P<body>.*?)```", re.S)
# a new shell's environment; the machine's pip settings (PIP_*: index, wheel folders, certificates) are
# the machine's, as /etc/pip.conf would be
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
             **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}


def run_block(body: str, timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        rc = subprocess.run(["bash", "-e", "-c", body], cwd=ROOT, env=CLEAN_ENV, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return {"rc": rc, "seconds": round(time.perf_counter() - start, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="the JSON of every block's result")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a block may run")
    args = p.parse_args()
    rows = []
    for i, m in enumerate(BLOCK.finditer((ROOT / "README.md").read_text(encoding="utf-8")), 1):
        first = m["body"].strip().splitlines()[0]
        row = {"block": i, "first_line": first, "mark": m["mark"] or "run"}
        if row["mark"] not in ("run", "skip", "check-only"):
            p.error(f"README block {i}: unknown readme-test mark {row['mark']!r}")
        if row["mark"] == "check-only":
            row.update(ran=False, why=m["why"])
        else:
            print(f"[block {i}] {first}", flush=True)
            row.update(ran=True, **run_block(m["body"], args.timeout))
            print(f"[block {i}] exit {row['rc']} in {row['seconds']:.0f} s", flush=True)
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps({"blocks": rows}, indent=1))
    ran = [r for r in rows if r["ran"]]
    passed = sum(r["rc"] == 0 for r in ran)
    print(f"{passed} of {len(ran)} run blocks exited 0; {len(rows) - len(ran)} check-only block(s) not run")
    return 0 if passed == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
