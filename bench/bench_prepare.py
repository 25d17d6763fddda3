"""Benchmark `dflash-train prepare` and the lazy dataset on synthetic conversations.

    python bench/bench_prepare.py                      # 1M conversations, SmolLM2 tokenizer
    python bench/bench_prepare.py --rows 20000 --out /tmp/p.json

1. Writes N synthetic chat conversations as JSONL (1-3 turns, optional system prompt,
   log-normal message lengths: ~590 tokens per conversation on average, p99 ~3K).
2. Runs `python -m dflash_train prepare` on them in a subprocess and reports rows/s,
   wall time, and peak memory: the ru_maxrss of the prepare process from wait4 (the largest
   single process: prepare or one of its workers) and the peak total RSS of the process
   tree, sampled every 0.5 s from /proc.
3. Opens the dataset in a fresh process and reports RSS (anonymous and file-backed)
   after open and after reading 10K random samples: anonymous memory is the `lengths`
   array (4 bytes/sample); file-backed pages are the mapped shard pages read, page cache
   that the OS can drop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were their one all we can her has there been if more when will would who so no model data training "
    "function value return example first also time new other some could these two may then do any like my now "
    "over such our man me even most made after only through very where years just those people how because "
    "system result number between each well three however while used should state both under again during "
    "memory token layer batch speed simple python code error file write read print list class import def"
).split()


def synth_jsonl(path: Path, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    # One long stream of random words; messages are slices of it (fast, realistic BPE behaviour).
    stream = " ".join(rng.choice(WORDS, 8_000_000)) + " "
    cut = len(stream) - 40_000

    def text(median_chars: float, sigma: float) -> str:
        n = int(min(rng.lognormal(np.log(median_chars), sigma), 30_000))
        a = int(rng.integers(0, cut))
        return stream[a:a + max(n, 1)].strip().capitalize() + "."

    with path.open("w") as fh:
        for i in range(rows):
            turns = int(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1]))
            msgs = [{"role": "system", "content": text(150, 0.5)}] if rng.random() < 0.3 else []
            for _ in range(turns):
                msgs.append({"role": "user", "content": text(250, 1.0)})
                msgs.append({"role": "assistant", "content": text(900, 0.9)})
            fh.write(json.dumps({"id": i, "messages": msgs}) + "\n")


def _tree_rss(pid: int) -> int:
    """Total RSS in bytes of a process and its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def measure_dataset(path: str, reads: int) -> dict:
    """Runs in a fresh process (so nothing else inflates its memory)."""
    import dflash_train.data.dataset as dsmod  # noqa: F401  (import cost outside the measurement)

    mem0 = {"anon_kb": _status_kb("RssAnon"), "file_kb": _status_kb("RssFile")}
    t = time.perf_counter()
    ds = dsmod.TokenDataset(path)
    open_s = time.perf_counter() - t
    mem1 = {"anon_kb": _status_kb("RssAnon"), "file_kb": _status_kb("RssFile")}
    idx = np.random.default_rng(0).integers(0, len(ds), reads)
    t = time.perf_counter()
    tokens = sum(int(ds[int(i)].input_ids.sum() > 0) for i in idx)  # touch the data
    read_s = time.perf_counter() - t
    mem2 = {"anon_kb": _status_kb("RssAnon"), "file_kb": _status_kb("RssFile")}
    return {
        "samples": len(ds), "open_s": round(open_s, 3), "reads": reads, "read_us_per_sample": round(read_s / reads * 1e6, 2),
        "rss_before_open": mem0, "rss_after_open": mem1, "rss_after_reads": mem2, "checked": tokens,
        "anon_bytes_per_sample_after_open": round((mem1["anon_kb"] - mem0["anon_kb"]) * 1024 / max(len(ds), 1), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--target", default="builtin")
    parser.add_argument("--workdir", default=None, help="where to put the JSONL and the dataset (default: a temp dir)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--reads", type=int, default=10_000)
    parser.add_argument("--reuse", action="store_true", help="reuse WORKDIR/synthetic.jsonl if it exists")
    parser.add_argument("--measure-dataset", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--generate", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_dataset:
        print(json.dumps(measure_dataset(args.measure_dataset, args.reads)))
        return 0
    if args.generate:
        synth_jsonl(Path(args.generate), args.rows)
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_prepare_"))
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "synthetic.jsonl", work / "dataset"
    if not (args.reuse and src.exists()):
        # In a subprocess: this process stays small, so the prepare process forked from it
        # does not inherit (and report as its own peak) the generator's memory.
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--generate", str(src), "--rows", str(args.rows)], check=True)
        print(f"generated {args.rows:,} conversations ({src.stat().st_size / 2**30:.2f} GiB) "
              f"in {time.perf_counter() - t:.0f} s", flush=True)

    cmd = [sys.executable, "-m", "dflash_train", "prepare", str(src), "-o", str(out), "--overwrite",
           "--target", args.target, "--workers", str(args.workers), "--no-progress"]
    peak, done = [0], threading.Event()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd)

    def sample() -> None:  # must not reap the process (poll/wait would): wait4 below does
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # wait4: the rusage of prepare itself, including its worker processes (max RSS of any one).
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    done.set()
    sampler.join()
    if rc:
        print(f"prepare failed with exit code {rc}", file=sys.stderr)
        return rc
    manifest = json.loads((out / "manifest.json").read_text())
    rows = manifest["counts"]["rows_read"]
    result = {
        "rows": rows,
        "workers": args.workers or max(1, (os.cpu_count() or 1) - 1),
        "cpu_cores": os.cpu_count(),
        "tokens": manifest["tokens"]["total"],
        "mean_tokens_per_row": round(manifest["tokens"]["total"] / max(manifest["counts"]["rows_kept"], 1), 1),
        "length_stats": manifest["tokens"]["length"],
        "input_gib": round(src.stat().st_size / 2**30, 3),
        "output_gib": round(sum(f.stat().st_size for f in out.iterdir()) / 2**30, 3),
        "prepare_wall_s": round(wall, 1),
        "prepare_loop_s": manifest["seconds"],
        "rows_per_s": round(rows / manifest["seconds"], 1),
        "rows_per_s_wall": round(rows / wall, 1),
        "tokens_per_s": round(manifest["tokens"]["total"] / manifest["seconds"]),
        "peak_rss_largest_process_mib": round(usage.ru_maxrss / 1024, 1),
        "peak_rss_process_tree_mib": round(peak[0] / 2**20, 1),
    }
    print(json.dumps(result, indent=2), flush=True)
    measured = subprocess.run([sys.executable, __file__, "--measure-dataset", str(out), "--reads", str(args.reads)],
                              check=True, capture_output=True, text=True)
    result["dataset"] = json.loads(measured.stdout)
    print(json.dumps(result["dataset"], indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}; data left in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
