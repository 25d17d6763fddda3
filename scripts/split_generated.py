"""Split `dflash-train generate` output by the prompt file each row came from (its `source.file`):
rows of held-out prompt files (`*-heldout.jsonl`) go to HELDOUT, all others to TRAIN. Rerunnable:
both outputs are rewritten from the inputs every time (atomically).

    python scripts/split_generated.py TRAIN.jsonl HELDOUT.jsonl GEN.jsonl [GEN.jsonl ...]
"""

import json
import os
import sys


def main(train: str, heldout: str, *inputs: str) -> None:
    counts = {train: 0, heldout: 0}
    with open(train + ".tmp", "w") as t, open(heldout + ".tmp", "w") as h:
        for path in inputs:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # the torn last line of a killed run: generate drops it on resume
                        print(f"skipping an unreadable line of {path} (a torn tail?)", file=sys.stderr)
                        continue
                    name = (row.get("source") or {}).get("file", "")
                    out, key = (h, heldout) if name.endswith("-heldout.jsonl") else (t, train)
                    out.write(line if line.endswith("\n") else line + "\n")
                    counts[key] += 1
    os.replace(train + ".tmp", train)
    os.replace(heldout + ".tmp", heldout)
    print(f"split {sum(counts.values()):,} generated rows: {counts[train]:,} -> {train}, {counts[heldout]:,} -> {heldout}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
