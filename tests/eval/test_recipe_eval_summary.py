"""scripts/recipe_eval_summary.py: the recipe's eval table, run as the device scripts run it."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "recipe_eval_summary.py"


def report(per_prompt: list[dict], cond: list[float]) -> dict:
    committed, rounds = sum(r["committed"] for r in per_prompt), sum(r["rounds"] for r in per_prompt)
    return {"overall": {"tau": committed / rounds, "tau_mean_of_prompts": None, "repetition_rate": 0.1,
                        "accept_rate_cond": cond}, "per_prompt": per_prompt}


def test_sets_sources_and_the_slots_acceptance(tmp_path):
    sets = {
        "humaneval": report([{"id": "HumanEval/0", "committed": 30, "rounds": 10}], [0.64, 0.5, float("nan")]),
        "sources-heldout": report([{"id": "math:a", "committed": 9, "rounds": 3},
                                   {"id": "math:b", "committed": 3, "rounds": 3},
                                   {"id": "stdlib-code:c", "committed": 8, "rounds": 2}], [0.7] * 12),
    }
    for name, rep in sets.items():
        (tmp_path / f"eval-{name}").mkdir()
        (tmp_path / f"eval-{name}" / "report.json").write_text(json.dumps(rep))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "humaneval                tau 3.000" in out
    assert "    slots 1-3 accepted given the slots before: 0.64 0.50 -" in out
    assert "    slots 1-8 accepted given the slots before: " + " ".join(["0.70"] * 8) + "\n" in out
    summary = json.loads((tmp_path / "eval-summary.json").read_text())
    assert summary["sources-heldout"]["by_source"]["math"]["tau"] == 2.0  # (9 + 3) / (3 + 3)
    assert summary["sources-heldout"]["by_source"]["stdlib-code"]["tau"] == 4.0
    assert summary["humaneval"]["accept_rate_cond"][:2] == [0.64, 0.5]
