"""Stops and deaths of a multi-process run, timed from outside (used by layouts.sh and scaling.sh).

    [NPROC=8 SPLIT="5 3" KILL_RANK=5] python3 dev/device/faults.py WORKDIR OUT -m dflash_train train ARGS...

For colocated on NPROC ranks (default 2) and split T+D (SPLIT, default "1 1"): SIGTERM to
torchrun once 5 steps are logged (time to exit, exit code, checkpoints written, then
`--resume` for 3 more steps: the first resumed step must be the checkpoint's + 1); and for
colocated a SIGKILL of rank KILL_RANK (default 1; time until every process is gone, whether a
survivor named the dead rank). CASES (default "term kill") picks them: "kill" alone for a run
whose split layout does not apply (a target sharded over every rank). One JSON line per case is
printed ("FAULT ...") and all of them go to OUT/faults.json.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


NPROC = int(os.environ.get("NPROC", "2"))
SPLIT = os.environ.get("SPLIT", "1 1").split()
KILL_RANK = int(os.environ.get("KILL_RANK", "1"))
CASES = os.environ.get("CASES", "term kill").split()


def torchrun(args, out, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--master-port",
           str(29500 + os.getpid() % 1000), *args, "--run.output_dir", str(out)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def steps(out):
    p = out / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
    return [r["step"] for r in rows if r.get("kind") == "train"]


def wait_steps(proc, out, n, limit=150):
    t = time.time()
    while len(steps(out)) < n:
        if proc.poll() is not None or time.time() - t > limit:
            return False
        time.sleep(0.2)
    return True


def rank_pid(launcher_pid, rank):
    for pid in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
        except (OSError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def main():
    work, out_dir, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    layouts = {"colocated": ["--pipeline.layout", "colocated"],
               "split": ["--pipeline.layout", "split", "--pipeline.target_ranks", SPLIT[0],
                         "--pipeline.drafter_ranks", SPLIT[1]]}
    results = []
    for name, extra in layouts.items() if "term" in CASES else ():
        out, log = work / f"term_{name}", work / f"term_{name}.log"
        proc = torchrun([*args, *extra], out, log)
        r = {"case": f"sigterm_torchrun_{name}_x{NPROC}", "started": wait_steps(proc, out, 5)}
        last = max(steps(out), default=0)
        if proc.poll() is not None:  # it never ran: keep why, go on with the next case
            r.update(exit_code=proc.returncode, log_tail=log.read_text(errors="replace")[-800:])
            print("FAULT " + json.dumps(r), flush=True)
            results.append(r)
            continue
        os.kill(proc.pid, signal.SIGTERM)
        t = time.time()
        proc.wait(timeout=120)
        r.update(seconds_to_exit=round(time.time() - t, 2), exit_code=proc.returncode, last_step_seen=last)
        ckpts = sorted(p.name for p in (out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else []
        r["checkpoints"] = ckpts
        text = log.read_text(errors="replace")
        r["stopped_line"] = "stopped by SIGTERM" in text
        r["sigkilled_by_torchrun"] = "forcefully exiting via" in text
        if ckpts:
            r.update(resume(work, args, extra, out, name))
        results.append(r)
        print("FAULT", json.dumps(r), flush=True)

    if "kill" in CASES:
        results.append(kill_case(work, args, layouts["colocated"]))
    (out_dir / "faults.json").write_text(json.dumps(results, indent=1))


def resume(work, args, extra, out, name):
    """`--resume` of a stopped run for 3 more steps: its checkpoint's step and what followed."""
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else []
    if not ckpts:
        return {"checkpoints": []}
    step = int(ckpts[-1].split("-")[1])
    more = [a if a != "100000" or args[i - 1] != "--run.max_steps" else str(step + 3) for i, a in enumerate(args)]
    p2 = torchrun([*more, *extra, "--resume"], out, work / f"resume_{name}.log")
    p2.wait(timeout=300)
    return {"checkpoint_step": step, "resume_exit": p2.returncode, "steps_after_resume": steps(out)[-4:]}


def kill_case(work, args, extra):
    """Colocated: SIGKILL of rank KILL_RANK once 5 steps are logged; time until every process is gone,
    then `--resume` from the last checkpoint (give the run a `--run.save_every` that leaves one)."""
    out, log = work / "kill_colocated", work / "kill_colocated.log"
    proc = torchrun([*args, *extra], out, log)
    r = {"case": f"sigkill_rank{KILL_RANK}_colocated_x{NPROC}", "started": wait_steps(proc, out, 5)}
    victim = rank_pid(proc.pid, KILL_RANK)
    if victim:
        os.kill(victim, signal.SIGKILL)
        t = time.time()
        proc.wait(timeout=120)
        text = log.read_text(errors="replace")
        r.update(seconds_to_all_exit=round(time.time() - t, 2), exit_code=proc.returncode,
                 survivor_named_victim=f"rank {KILL_RANK} sent no heartbeat" in text,
                 sigkilled_by_torchrun="forcefully exiting via" in text)
        r.update(resume(work, args, extra, out, "kill"))
    else:
        proc.kill()
    print("FAULT", json.dumps(r), flush=True)
    return r


if __name__ == "__main__":
    main()
