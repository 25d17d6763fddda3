"""The evaluation report: `report.json` (everything) and `report.png` (what a person looks at)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    """JSON without NaN (not valid JSON): NaN -> null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(report: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(_clean(report), indent=2) + "\n")
        tmp.replace(path)
    except BaseException:  # a full disk: no half report left next to the old one
        tmp.unlink(missing_ok=True)
        raise
    return path


def plot_report(report: dict, path: Path, title: str = "") -> Path:
    """Two panels: accepted drafts per verify forward (histogram, 0..B-1) and acceptance per
    block position (unconditional and given every earlier slot accepted)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    o = report["overall"]
    B = report["block_size"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    hist = o["accept_hist"]
    total = max(sum(hist), 1)
    ax1.bar(range(B), [h / total for h in hist], color="#4C72B0")
    ax1.set_xticks(range(B))
    ax1.set_xlabel("accepted drafts per verify forward (tokens committed = accepted + 1)")
    ax1.set_ylabel("fraction of verify forwards")
    ax1.axvline(o["tau"] - 1, color="#C44E52", linestyle="--", label=f"mean: tau - 1 = {o['tau'] - 1:.2f}")
    ax1.legend(loc="upper right")
    ax1.set_title(f"acceptance histogram ({o['rounds']} verify forwards)")
    slots = list(range(1, B))
    nan = float("nan")
    ax2.plot(slots, [nan if v is None else v for v in o["accept_rate"]], "o-", label="P(slot k accepted)")
    ax2.plot(slots, [nan if v is None else v for v in o["accept_rate_cond"]], "s--",
             label="P(slot k accepted | slots < k accepted)")
    ax2.set_xticks(slots)
    ax2.set_ylim(0, 1.02)
    ax2.set_xlabel("draft slot k in the block")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("acceptance per block position")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right", fontsize=8)
    head = f"tau {o['tau']:.3f} tokens/forward"
    if o.get("speedup") is not None:
        head += (f" | {o['spec_tok_per_s']:.1f} vs {o['greedy_tok_per_s']:.1f} tok/s greedy "
                 f"= {o['speedup']:.2f}x | {o['prompts']} prompts")
    fig.suptitle(f"{title}\n{head}" if title else head, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_lines(report: dict) -> list[str]:
    o = report["overall"]
    B = report["block_size"]
    lines = [f"prompts {o['prompts']}, {o['new_tokens']:,} new tokens, {o['rounds']:,} verify forwards, block {B}",
             f"tau (tokens per target forward): {o['tau']:.3f}   (mean over prompts {o['tau_mean_of_prompts']:.3f})"]
    hist = o["accept_hist"]
    total = max(sum(hist), 1)
    lines.append("accepted drafts histogram: " + " ".join(f"{a}:{h / total:.0%}" for a, h in enumerate(hist)))
    rate = [f"{v:.2f}" if v == v else "-" for v in o["accept_rate"]]
    lines.append("acceptance per slot 1..B-1: " + " ".join(rate))
    lines.append(f"speculative: {o['spec_tok_per_s']:.1f} tok/s (drafter {o['draft_seconds']:.1f}s, target verify "
                 f"{o['verify_seconds']:.1f}s of {o['spec_seconds']:.1f}s)")
    replay = o.get("replay")
    if replay:
        lines.append(f"recurrent target layers rolled back by replaying accepted tokens: {replay['rounds']:,} of "
                     f"{replay['of_rounds']:,} verify forwards were followed by a forward of {replay['tokens']:,} "
                     f"tokens in all (in the verify time above)")
    by_pos = o.get("tau_by_position") or {}
    if by_pos:
        lines.append("tau by answer position: " + ", ".join(f"{k}: {v:.2f}" for k, v in by_pos.items())
                     + f" | repetition rate (6-grams seen earlier in the output) {o.get('repetition_rate', float('nan')):.2f}")
    if "speedup" in o:
        lines.append(f"plain greedy: {o['greedy_tok_per_s']:.1f} tok/s  ->  speedup {o['speedup']:.2f}x"
                     + _spread(o))
        if o.get("speedup_is_noise"):
            lines.append(f"no draft token was accepted (tau {o['tau']:.3f}): speculative decoding cannot be faster "
                         f"than plain greedy here; a speedup above 1 is timing noise")
        kinds = o.get("divergences", {})
        lines.append(f"output equals plain greedy decoding: {o['matches_greedy']}/{o['prompts']} prompts"
                     + (f"; differences: {kinds.get('near_tie', 0)} at a near-tie of the target's top two logits "
                        f"(expected in reduced precision), {kinds.get('mismatch', 0)} at a clear margin (a bug)"
                        if o["matches_greedy"] != o["prompts"] else ""))
    batched = report.get("batched")
    if batched:
        spec = batched["spec"]
        line = (f"batched, {batched['slots']} at once: {spec['committed_tok_per_s']:,.0f} committed tok/s "
                f"(tau {spec['tau']:.2f})")
        if "greedy" in batched:
            line += f" vs {batched['greedy']['committed_tok_per_s']:,.0f} greedy = {batched['speedup']:.2f}x"
        lines.append(line)
    return lines


def cpu_cost_line(report: dict) -> str | None:
    """On a CPU: what a verify forward and a draft cost in plain greedy tokens, and so the tau from which
    speculation pays (why a CPU's speedup is below 1 where a GPU's is above); None without the timings."""
    o, B = report["overall"], report["block_size"]
    if not (o.get("greedy_tok_per_s") and o.get("rounds")):
        return None
    per_token = 1 / o["greedy_tok_per_s"]  # seconds of one plain greedy token here
    verify = o["verify_seconds"] / o["rounds"] / per_token
    draft = o["draft_seconds"] / o["rounds"] / per_token
    return (f"on this CPU a verify forward of {B} tokens cost {verify:.1f}x a plain greedy token and the "
            f"drafter {draft:.1f}x, so speculation pays only once tau passes ~{verify + draft:.1f} "
            f"(measured: {o['tau']:.2f}); on a GPU a forward of {B} tokens costs about as much as one")


def _spread(o: dict) -> str:
    n, spread = o.get("timing_repeats", 1), o.get("speedup_spread")
    if n < 2 or not spread:
        return "  (one timing, no spread)"
    return f"  (median of {n} timings, spread {spread[0]:.2f}-{spread[1]:.2f}x)"
