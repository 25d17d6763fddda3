"""Split `dflash-train generate` output by the prompt file each row came from (its `source.file`):
rows of held-out prompt files (`*-heldout.jsonl`) go to HELDOUT, all others to TRAIN. Rerunnable:
both outputs are rewritten from the inputs every time (atomically).

    python scripts/split_generated.py TRAIN.jsonl HELDOUT.jsonl GEN.jsonl [GEN.jsonl ...]
        [--weights self-instruct=3,package-code=0.5] [--exclude chat [--exclude FILE ...]]

--weights sets the data mix of TRAIN: a training row of source S is written int(w) times, plus
once more when the fraction of its id's hash is below w - int(w) (so 0 drops the source, 0.5
keeps a fixed half, 2 writes every row twice; the same rows on every rerun). Sources not named
keep weight 1; held-out rows are never weighted. A row's source is its prompt file's name
without the shard suffix (`package-code-0of2.jsonl` -> `package-code`); self-instructed rows,
which have no prompt file, are `self-instruct`.

--exclude keeps an evaluation prompt set out of TRAIN (`chat`, `humaneval` or a prompt file, as
`dflash-train eval --prompts` reads them): a training row whose first user turn near-duplicates
one of its prompts (Jaccard >= 0.5 of lower-cased word 3-grams, the rule `dflash-train prompts`
de-duplicates its sources by) is left out. Self-instructed chats need it: their held-out set is
the shipped chat prompts, which the same model wrote with another seed, and a short request can
come out nearly word for word in both ("the benefits of using AI in healthcare").
"""

import argparse
import hashlib
import json
import os
import re
import sys

import numpy as np

SELF_INSTRUCT = "self-instruct"


def source_of(row: dict) -> str:
    """The source of a training row (held-out rows never reach here)."""
    name = (row.get("source") or {}).get("file", "")
    if not name:
        return SELF_INSTRUCT
    return re.sub(r"(-\d+of\d+)?\.jsonl$", "", os.path.basename(name))


def fail(message: str) -> None:
    """Bad input: one line, exit status 2."""
    print(f"split_generated: {message}", file=sys.stderr)
    sys.exit(2)


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
            fail(f"--weights: {item!r} is not SOURCE=WEIGHT with a weight >= 0")
        weights[name.strip()] = weight
    return weights


def read_rows(inputs: list[str], *, warn: bool):
    """(line, row) of every readable row of `inputs`, in order; the line ends with a newline."""
    for path in inputs:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the torn last line of a killed run: generate drops it on resume
                    if warn:
                        print(f"skipping an unreadable line of {path} (a torn tail?)", file=sys.stderr)
                    continue
                yield (line if line.endswith("\n") else line + "\n"), row


def is_heldout(row: dict) -> bool:
    return (row.get("source") or {}).get("file", "").endswith("-heldout.jsonl")


def first_user_turn(row: dict) -> str:
    for message in row.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


def excluded_rows(inputs: list[str], sets: list[str]) -> np.ndarray:
    """bool per training row (in `read_rows` order): its first user turn near-duplicates a prompt of `sets`."""
    from dflash_train.data.dedup import near_duplicate_of
    from dflash_train.data.prompt_sources.build import NGRAM
    from dflash_train.data.prompt_sources.config import PromptsConfig
    from dflash_train.data.prompt_sources.items import word_ids
    from dflash_train.data.prompts import load_prompts
    from dflash_train.utils.errors import DFlashError

    try:
        prompts = [p for spec in sets for p in load_prompts(spec)]
    except DFlashError as exc:  # checked before anything is written
        fail(f"--exclude: {exc}")
    texts = [p.messages[-1]["content"] if p.messages else p.text or "" for p in prompts]
    turns = [word_ids(first_user_turn(row)) for _, row in read_rows(inputs, warn=False) if not is_heldout(row)]
    # the threshold and n-gram `dflash-train prompts` de-duplicates its sources by, by default
    return near_duplicate_of(turns, [word_ids(t) for t in texts], threshold=PromptsConfig.dedup_threshold,
                             ngram=NGRAM, seed=0)


def main(train: str, heldout: str, inputs: list[str], weights: dict[str, float], exclude: list[str]) -> None:
    counts = {train: 0, heldout: 0}
    read: dict[str, int] = {}
    written: dict[str, int] = {}
    left_out: dict[str, int] = {}
    drop = excluded_rows(inputs, exclude) if exclude else None
    k = -1  # index of the training row
    with open(train + ".tmp", "w") as t, open(heldout + ".tmp", "w") as h:
        for line, row in read_rows(inputs, warn=True):
            if is_heldout(row):
                h.write(line)
                counts[heldout] += 1
                continue
            source = source_of(row)
            k += 1
            if drop is not None and drop[k]:
                left_out[source] = left_out.get(source, 0) + 1
                continue
            n = copies(row, weights.get(source, 1.0))
            t.write(line * n)
            counts[train] += n
            read[source] = read.get(source, 0) + 1
            written[source] = written.get(source, 0) + n
    unknown = sorted(set(weights) - set(read))
    if unknown:  # a misspelt source would silently leave the mix unchanged
        for tmp in (train + ".tmp", heldout + ".tmp"):
            os.remove(tmp)
        fail(f"--weights names source(s) {', '.join(unknown)} that no training row of "
             f"{', '.join(inputs)} has; the sources are: {', '.join(sorted(read))}")
    os.replace(train + ".tmp", train)
    os.replace(heldout + ".tmp", heldout)
    print(f"split {counts[train] + counts[heldout]:,} rows: {counts[train]:,} -> {train}, {counts[heldout]:,} -> {heldout}")
    if exclude:
        detail = ", ".join(f"{source} {n:,}" for source, n in sorted(left_out.items())) or "none"
        print(f"  left out of {train}: {sum(left_out.values()):,} rows near-duplicating a prompt of "
              f"{', '.join(exclude)} ({detail})")
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
    parser.add_argument("--exclude", action="append", default=[], metavar="PROMPTS",
                        help="an eval prompt set (chat, humaneval, FILE) whose near-duplicates stay out of TRAIN")
    args = parser.parse_args()
    main(args.train, args.heldout, args.inputs, parse_weights(args.weights), args.exclude)
