"""Seconds of each phase of the held-out split, on bench/split_workers.py's random dataset."""
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench")
import split_workers  # noqa: E402

from dflash_train.data.dataset import TokenDataset  # noqa: E402


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        print(f"  {name} {time.perf_counter() - t:.1f} s", flush=True)
        return out
    return wrapper


if __name__ == "__main__":  # torch-bringing imports here: the workers import this file as their main
    from dflash_train.data import splits
    from dflash_train.data.config import DataConfig
    for name in ("prompt_hashes", "common_shingles", "near_duplicate_of", "_drop_duplicates"):
        setattr(splits, name, timed(name, getattr(splits, name)))
    with tempfile.TemporaryDirectory() as tmp:
        split_workers.write_dataset(Path(tmp), int(sys.argv[1]))
        cfg = DataConfig(path="bench", eval_fraction=0.003, dedup_threshold=0.5, dedup_ngram=3)
        for w in sys.argv[2:]:
            t = time.perf_counter()
            splits.compute_split(cfg, 0, TokenDataset(tmp), workers=int(w))
            print(f"workers {w}: {time.perf_counter() - t:.1f} s", flush=True)
