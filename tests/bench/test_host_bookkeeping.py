"""dev/experiments/host_bookkeeping.py: the per-slot and the array bookkeeping finish every row alike."""

from .scripts import load_script

host_bookkeeping = load_script("dev/experiments/host_bookkeeping.py")


def test_both_bookkeepings_write_the_same_rows(tmp_path):
    """Short rows (a stop token 1 in 6, at most 9 tokens) in 24 slots: many refills, rows that
    stop at their first token and rows cut at the limit; both ways finish the same rows with
    the same tokens and reasons."""
    out = tmp_path / "hb.json"
    r = host_bookkeeping.main(["--slots", "24", "--steps", "60", "--max-new", "9", "--mean-len", "6", "--repeats", "1",
                               "--out", str(out)])
    assert out.exists() and r["same_tokens"] and r["rows_compared"] > 100
    assert r["per_slot"]["rows_finished"] - r["rows_compared"] <= 24  # at most the rows left in their slots
    assert r["per_slot"]["us_per_step"] > 0 and r["arrays"]["us_per_step"] > 0


def test_the_comparison_sees_a_wrong_token():
    """The check can fail: a bookkeeping that keeps stop tokens writes other rows."""
    args = host_bookkeeping.parse_args(["--slots", "8", "--steps", "40", "--max-new", "9", "--mean-len", "4"])
    _, want, _ = host_bookkeeping.simulate(host_bookkeeping.PerSlot(8, 9), args)
    book = host_bookkeeping.Arrays(8, 9)
    book.table.stop_ids = book.table.stop_ids[:0]  # no stop token known
    _, got, _ = host_bookkeeping.simulate(book, args)
    common = want.keys() & got.keys()
    assert common and any(want[t] != got[t] for t in common)
