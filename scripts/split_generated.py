"""Split `dflash-train generate` output by the prompt file each row came from (its `source.file`):
rows of held-out prompt files (`*-heldout.jsonl`) go to HELDOUT, all others to TRAIN. Rerunnable:
both outputs are rewritten from the inputs every time (atomically).

    python scripts/split_generated.py TRAIN.jsonl HELDOUT.jsonl GEN.jsonl [GEN.jsonl ...]
        [--weights self-instruct=3,package-code=0.5]

--weights sets the data mix of TRAIN: a training row of source S is written int(w) times, plus
once more when the fraction of its id's hash is below w - int(w) (so 0 drops the source, 0.5
keeps a fixed half, 2 writes every row twice; the same rows on every rerun). Sources not named
keep weight 1; held-out rows are never weighted. A row's source is its prompt file's name
without the shard suffix (`package-code-0of2.jsonl` -> `package-code`); self-instructed rows,
which have no prompt file, are `self-instruct`.
"""

import argparse
import hashlib
import json
import os
import re
import sys

SELF_INSTRUCT = "self-instruct"


def source_of(row: dict) -> str:
    """The source of a training row (held-out rows never reach here)."""
    name = (row.get("source") or {}).get("file", "")
    if not name:
        return SELF_INSTRUCT
    return re.sub(r"(-\d+of\d+)?\.jsonl$", "", os.path.basename(name))


def hash_fraction(row_id: str) -> float:
    """A row's fixed place in [0, 1): the first 8 bytes of sha256(id)."""
    return int.from_bytes(hashlib.sha256(row_id.encode()).digest()[:8], "big") / 2.0 ** 64


def copies(row: dict, weight: float) -> int:
    whole = int(weight)
    return whole + (1 if hash_fraction(str(row.get("id", ""))) < weight - whole else 0)


def parse_weights(text: str) -> dict[str, float]:
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or weight < 0:
            raise SystemExit(f"--weights: {item!r} is not SOURCE=WEIGHT with a weight >= 0")
        weights[name.strip()] = weight
    return weights


def main(train: str, heldout: str, inputs: list[str], weights: dict[str, float]) -> None:
    counts = {train: 0, heldout: 0}
    read: dict[str, int] = {}
    written: dict[str, int] = {}
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
                    line = line if line.endswith("\n") else line + "\n"
                    if (row.get("source") or {}).get("file", "").endswith("-heldout.jsonl"):
                        h.write(line)
                        counts[heldout] += 1
                        continue
                    source = source_of(row)
                    n = copies(row, weights.get(source, 1.0))
                    t.write(line * n)
                    counts[train] += n
                    read[source] = read.get(source, 0) + 1
                    written[source] = written.get(source, 0) + n
    unknown = sorted(set(weights) - set(read))
    if unknown:  # a misspelt source would silently leave the mix unchanged
        for tmp in (train + ".tmp", heldout + ".tmp"):
            os.remove(tmp)
        raise SystemExit(f"--weights names source(s) {', '.join(unknown)} that no training row of "
                         f"{', '.join(inputs)} has; the sources are: {', '.join(sorted(read))}")
    os.replace(train + ".tmp", train)
    os.replace(heldout + ".tmp", heldout)
    print(f"split {counts[train] + counts[heldout]:,} rows: {counts[train]:,} -> {train}, {counts[heldout]:,} -> {heldout}")
    if weights:
        for source in sorted(read):
            print(f"  {source:14s} {read[source]:>8,} read, {written[source]:>8,} written (weight {weights.get(source, 1.0):g})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train")
    parser.add_argument("heldout")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--weights", default="", help="SOURCE=WEIGHT,... (the data mix of TRAIN)")
    args = parser.parse_args()
    main(args.train, args.heldout, args.inputs, parse_weights(args.weights))
