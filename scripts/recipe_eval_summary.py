"""The recipe's eval table: measured tau of every eval set, and per source for the mixed sets.

    python scripts/recipe_eval_summary.py runs/smollm2-x2        # reads eval-*/report.json

The mixed sets (eval-sources-heldout, eval-sources-train) hold the first prompts of every
source; a prompt's id starts with its source (`math:units:...`), so the per-source tau is read
back from the report's per-prompt rows: committed tokens over target forwards, summed over the
source's prompts (the same ratio as the report's overall tau). Each set also prints its first
slots' acceptance given the slots before them (the report's `accept_rate_cond`): where a
drafter change lands along the block. Held-out vs training tau of one
source is the memorisation check (docs/recipe-smollm2.md). Writes <work>/eval-summary.json.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

SLOTS_SHOWN = 8  # the late slots of a block are reached by few rounds: their rates are noise

def source_of(prompt_id: str) -> str:
    return prompt_id.split(":", 1)[0] if ":" in prompt_id else "-"


def by_source(per_prompt: list[dict]) -> dict[str, dict]:
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0])
    for row in per_prompt:
        s = sums[source_of(str(row["id"]))]
        s[0] += row["committed"]
        s[1] += row["rounds"]
        s[2] += row.get("repetition_rate") or 0.0
        s[3] += 1
    return {src: {"tau": c / r if r else 0.0, "prompts": n, "repetition_rate": rep / n}
            for src, (c, r, rep, n) in sorted(sums.items())}


def main(work: Path) -> dict:
    summary = {}
    for path in sorted(work.glob("eval-*/report.json")):
        report = json.loads(path.read_text())
        o = report["overall"]
        name = path.parent.name.removeprefix("eval-")
        entry = {"tau": o["tau"], "tau_mean_of_prompts": o.get("tau_mean_of_prompts"),
                 "tau_by_position": o.get("tau_by_position"),
                 "repetition_rate": o.get("repetition_rate"), "speedup": o.get("speedup"),
                 "prompts": len(report["per_prompt"]), "accept_rate_cond": o.get("accept_rate_cond")}
        by_pos = ", ".join(f"{k}: {v:.2f}" for k, v in list((o.get("tau_by_position") or {}).items())[:2])
        rep = o.get("repetition_rate")
        mean = o.get("tau_mean_of_prompts")
        print(f"{name:<24} tau {o['tau']:.3f}  mean of prompts {mean if mean is None else round(mean, 3)}  ({by_pos})  repetition {rep if rep is None else round(rep, 3)}"
              f"  prompts {entry['prompts']}")
        cond = o.get("accept_rate_cond") or []
        if cond:  # where a drafter change lands: each slot's acceptance in the rounds that reach it
            print(f"    slots 1-{min(len(cond), SLOTS_SHOWN)} accepted given the slots before: "
                  + " ".join("-" if v is None or v != v else f"{v:.2f}" for v in cond[:SLOTS_SHOWN]))
        if name.startswith("sources-"):
            entry["by_source"] = by_source(report["per_prompt"])
            for src, s in entry["by_source"].items():
                print(f"    {src:<20} tau {s['tau']:.3f}  repetition {s['repetition_rate']:.3f}  prompts {s['prompts']}")
        summary[name] = entry
    out = work / "eval-summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    if not Path(sys.argv[1]).is_dir():
        print(f"recipe_eval_summary: {sys.argv[1]}: no such folder", file=sys.stderr)
        sys.exit(2)
    main(Path(sys.argv[1]))
