"""bench/bench_dspark_draft.py on the tiny preset: every variant (DFlash, dspark's vanilla and gated
heads) is measured, and the head it times alone drafts what the engine's propose() drafts."""

from __future__ import annotations

import json

from .scripts import load_script

bench = load_script("bench/bench_dspark_draft.py")


def test_every_head_is_timed_and_drafts_as_propose(tmp_path):
    out = tmp_path / "draft.json"
    r = bench.main(["preset:tiny", "--device", "cpu", "--slots", "1", "3", "--context", "40", "--repeats", "1",
                    "--markov-rank", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == r
    rounds = {(row["variant"], row["slots"]): row for row in r["rounds"]}
    assert set(rounds) == {(v, s) for v in ("dflash", "dspark", "gated") for s in (1, 3)}
    for row in rounds.values():
        assert row["head_drafts_as_propose"] is True
        assert row["head_ms"] > 0 and row["propose_ms"] > 0  # timings are the bench's to report, not to test
