"""Speculative decoding on the static engine (speculative/engine.py): speed and losslessness.

    # on a GPU (bf16, CUDA graphs, torch.compile'd layers), a target and an exported drafter:
    python bench/bench_spec_decode.py TARGET_DIR --drafter DRAFTER_DIR --out runs/bench_spec_decode.json
    # no trained drafter: a random one (tau ~ 1, so this measures the overheads)
    python bench/bench_spec_decode.py TARGET_DIR --random-drafter --out runs/bench_spec_decode.json
    # CPU smoke check of the script itself (tiny random target, fp32):
    python bench/bench_spec_decode.py preset:tiny --random-drafter --device cpu --num-prompts 3 \\
        --max-new-tokens 24 --batch-slots 4 --batch-prompts 6 --out /tmp/bench_spec_decode.json

Measured, warm-up excluded (every CUDA graph is captured and every compilation done before
the timed runs):

* batch 1: plain greedy tok/s (T = 1 verify, no drafter) and speculative tok/s over the same
  prompts, one at a time; tau (committed tokens per verify), wall-clock speedup and its
  ratio to tau (1.0 = no overhead at all); per-round time split: draft (drafter context +
  proposal), verify (target forward + acceptance) and host (everything else: the one sync,
  bookkeeping, launches); tok/s counts new tokens over prefill + decode.
* lossless: each speculative output against the greedy one; the first divergence and the
  target's top-1 minus top-2 margin there, classified near-tie / mismatch (speculative/decoders.py).
* batched: `--batch-prompts` prompts through `--batch-slots` slots, refilled as sequences
  finish; committed tok/s over the wall clock of the whole run, greedy and speculative, and the
  speedup's ratio to tau; the engine's rounds, the wall ms per round (against a step's own cost,
  bench/profile_spec_round.py: prefills and host work are the rest) and the share of slots a
  round kept busy (the rest: rounds with few rows left, refills waiting for free slots).
* `--overlap-rounds both`: all of it with the engine's pipelined rounds (round r+1 launched
  before round r is read, the default) and one round at a time, on the same engine and graphs:
  keys `batch1` / `batched` and `batch1_sequential` / `batched_sequential`.

Times at batch 1 are the wall clock of each call (a run ends when its last round is read; with
pipelined rounds that can be one round launched behind the row's end, and it counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dflash_train.data.prompts import encode_prompt, load_prompts
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.builtin import stop_token_ids
from dflash_train.generate.decoder import UnsupportedModelError, check_supported
from dflash_train.speculative.decoders import first_divergence, make_spec_decoder
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.loop import DecodeResult
from dflash_train.target.loading import choose_mask_token_id, load_target_model, load_tokenizer
from dflash_train.target.presets import is_preset
from dflash_train.utils.device import sync


def say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="Hugging Face model directory (or preset:NAME, random weights, no tokenizer)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--drafter", type=Path, help="exported drafter directory (config.json + model.safetensors)")
    group.add_argument("--random-drafter", action="store_true", help="a randomly initialised drafter for the target")
    p.add_argument("--block-size", type=int, default=16, help="block size of --random-drafter")
    p.add_argument("--prompts", default="chat", help="prompt set: chat, humaneval or a file (eval/prompts.py)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts decoded at batch 1 (each in both modes)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-slots", type=int, default=64, help="slots of the batched runs (0: skip them)")
    p.add_argument("--batch-prompts", type=int, default=128, help="prompts of the batched runs (the set, cycled)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bfloat16, float32")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the per-layer functions")
    p.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto",
                   help="the engine's cache attention (generate/attention.py; auto: flex when compiled on CUDA)")
    p.add_argument("--draft-window", type=int, default=0, help="decode the drafter's full-attention layers with this "
                   "sliding window (0: its own attention; speculative/static_drafter.py)")
    p.add_argument("--overlap-rounds", choices=["on", "off", "both"], default="on",
                   help="launch round r+1 before reading round r (on), one round at a time (off), or both (A/B)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def load(args, device: torch.device, dtype: torch.dtype):
    """(target, tokenizer or None, drafter, stop ids)."""
    model = load_target_model(args.target, dtype=dtype, device=device)
    tokenizer = None if is_preset(args.target) else load_tokenizer(args.target)
    rows = model.get_input_embeddings().weight.shape[0]
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    else:
        mask = choose_mask_token_id(tokenizer, rows) if tokenizer is not None else rows - 1
        cfg = drafter_config_from_target(model.config, mask_token_id=mask, block_size=args.block_size)
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype)
    stop = stop_token_ids(tokenizer, model) if tokenizer is not None else set()
    return model, tokenizer, drafter.eval(), stop


def prompt_ids(args, tokenizer, vocab: int) -> list[tuple[str, list[int]]]:
    if tokenizer is None:  # random-weight presets: random prompts of chat-like lengths
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(20, 120, (args.num_prompts,), generator=gen).tolist()
        return [(f"random-{i}", torch.randint(3, vocab, (n,), generator=gen).tolist()) for i, n in enumerate(lengths)]
    return [(p.id, encode_prompt(tokenizer, p)) for p in load_prompts(args.prompts, args.num_prompts)]



def totals(results: list[DecodeResult], walls: list[float]) -> dict:
    """`walls`: each call's wall clock (its result's `seconds` ends at its last token's read)."""
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(walls)
    prefill = sum(r.prefill_seconds for r in results)
    rounds = sum(len(r.rounds) for r in results)
    draft, verify = sum(r.draft_seconds for r in results), sum(r.verify_seconds for r in results)
    host = seconds - prefill - draft - verify
    ms = lambda s: round(1000 * s / rounds, 4) if rounds else None  # noqa: E731 - per round, in ms
    return {
        "tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 1),
        "decode_tok_s": round((tokens - len(results)) / max(seconds - prefill, 1e-9), 1),
        "rounds": rounds, "tau": round((tokens - len(results)) / rounds, 4) if rounds else None,
        "prefill_seconds": round(prefill, 4),
        "ms_per_round": {"draft": ms(draft), "verify": ms(verify), "host": ms(host), "total": ms(seconds - prefill)},
    }  # fmt: skip


def batch_one(engine, prompts, max_new: int) -> tuple[dict, list[DecodeResult]]:
    greedy, spec, per_prompt = [], [], []
    walls: dict[str, list[float]] = {"greedy": [], "spec": []}
    counts = {"identical": 0, "near_tie": 0, "mismatch": 0}

    def timed(ids, mode: str) -> DecodeResult:
        t0 = time.perf_counter()
        res = engine.generate(ids, max_new, speculative=mode == "spec")
        walls[mode].append(time.perf_counter() - t0)  # the engine waits for its last round
        return res

    for i, (pid, ids) in enumerate(prompts):
        g = timed(ids, "greedy")
        s = timed(ids, "spec")
        greedy.append(g)
        spec.append(s)
        div = first_divergence(s.tokens, g)
        counts[div.kind] += 1
        per_prompt.append({"id": pid, "prompt_tokens": len(ids), "new_tokens": len(s.tokens), "tau": round(s.tau, 3),
                           "greedy_tok_s": round(len(g.tokens) / g.seconds, 1),
                           "spec_tok_s": round(len(s.tokens) / s.seconds, 1), "divergence": dataclasses.asdict(div)})
        say(f"  [{i + 1}/{len(prompts)}] {pid}: {len(ids)} prompt tokens, {len(s.tokens)} new, tau {s.tau:.2f}, "
            f"greedy {len(g.tokens) / g.seconds:.0f} tok/s, spec {len(s.tokens) / s.seconds:.0f} tok/s, {div.kind}"
            + (f" at {div.position} (margin {div.margin})" if div.position is not None else ""))
    out = {"greedy": totals(greedy, walls["greedy"]), "spec": totals(spec, walls["spec"]), "lossless": counts,
           "per_prompt": per_prompt}
    out["speedup"] = round(out["spec"]["tok_s"] / out["greedy"]["tok_s"], 3)
    tau = out["spec"]["tau"]
    out["speedup_over_tau"] = round(out["speedup"] / tau, 3) if tau else None
    return out, greedy


def batched(engine, prompts, max_new: int, device, reference: dict[tuple, list[int]]) -> dict:
    out = {}
    ids = [p for _, p in prompts]
    for mode in ("greedy", "spec"):
        sync(device)
        launched = engine.rounds_launched
        t0 = time.perf_counter()
        results = engine.generate_batch(ids, max_new, speculative=mode == "spec")
        sync(device)
        wall = time.perf_counter() - t0
        launched = engine.rounds_launched - launched
        tokens = sum(len(r.tokens) for r in results)
        rounds = sum(len(r.rounds) for r in results)
        same = [r.tokens == reference[tuple(p)] for p, r in zip(ids, results) if tuple(p) in reference]
        # where the time goes: ms per engine round (every slot's step, prefills and host work
        # included) against the step's own cost, and how many slots a round kept busy
        out[mode] = {"prompts": len(ids), "tokens": tokens, "seconds": round(wall, 4),
                     "committed_tok_s": round(tokens / wall, 1),
                     "tau": round((tokens - len(results)) / rounds, 4) if rounds else None,
                     "engine_rounds": launched, "ms_per_engine_round": round(1e3 * wall / launched, 4) if launched else None,
                     "slot_use": round(rounds / (launched * engine.slots), 4) if launched else None,
                     "same_as_batch1_greedy": round(sum(same) / len(same), 3) if same else None}
        say(f"  batched {mode}: {len(ids)} prompts, {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s; "
            f"{launched} rounds, {out[mode]['ms_per_engine_round']} ms each, {out[mode]['slot_use']:.0%} of the slots busy")
    out["speedup"] = round(out["spec"]["committed_tok_s"] / out["greedy"]["committed_tok_s"], 3)
    tau = out["spec"]["tau"]
    out["speedup_over_tau"] = round(out["speedup"] / tau, 3) if tau else None  # 1.0: no overhead at all
    return out


def warm(engine, prompts, max_len_needed: int, slots: int) -> None:
    """Capture every graph the timed runs can need, then a short run of every prompt in each
    mode: allocator growth, and the kernel choice of the eager prefill at each prompt length,
    which otherwise lands in whichever mode decodes a prompt first."""
    engine.warm_up(max_len_needed)
    batch = [p for _, p in prompts]
    for speculative in (False, True):
        engine.generate_batch(batch, 4, speculative=speculative)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
              "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}
    dtype = dtypes[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    t_setup = time.perf_counter()
    model, tokenizer, drafter, stop = load(args, device, dtype)
    prompts = prompt_ids(args, tokenizer, model.get_input_embeddings().weight.shape[0])
    B = drafter.config.block_size
    longest = max(len(p) for _, p in prompts)
    max_len = longest + args.max_new_tokens + B
    config = {"target": args.target, "drafter": str(args.drafter) if args.drafter else "random",
              "block_size": B, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__,
              "compile": not args.no_compile and device.type == "cuda", "stop_ids": sorted(stop)}
    say(f"bench_spec_decode: {args.target} + {config['drafter']} drafter (B = {B}), {len(prompts)} prompts x "
        f"{args.max_new_tokens} new tokens, {device} {config['dtype']}")
    engine_kw = dict(cuda_graphs=not args.no_cuda_graphs, compile=config["compile"], attention=args.attention,
                     draft_window=args.draft_window or None)
    config["draft_window"] = args.draft_window or None
    say("building the batch-1 engine (compiling, capturing CUDA graphs, warm-up runs) ...")
    one = make_spec_decoder(model, drafter, stop, slots=1, max_len=max_len, **engine_kw)
    config["engine"] = type(one).__name__
    config["attention"] = getattr(one, "attention", None)
    warm(one, prompts, max_len, 1)
    sync(device)
    config["cuda_graphs"] = getattr(one, "use_graphs", False)  # False too where a capture failed
    results = {"config": config, "setup_seconds": round(time.perf_counter() - t_setup, 2)}
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.overlap_rounds]
    config["overlap_rounds"] = args.overlap_rounds
    say(f"setup (load, compile, graph capture, warm-up) {results['setup_seconds']:.1f} s; batch 1:")
    for overlap in modes:
        if isinstance(one, SpecEngine):
            one.overlap_rounds = overlap
        key = "batch1" if overlap == modes[0] else "batch1_sequential"
        say(f"batch 1, {'pipelined rounds' if overlap else 'one round at a time'}:")
        results[key], greedy = batch_one(one, prompts, args.max_new_tokens)
    getattr(one, "close", lambda: None)()  # the Hugging Face fallback's hooks
    del one
    gc.collect()  # the engine's graphs and caches (lambdas hold reference cycles)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.batch_slots and static_engine_supported(model):
        batch_prompts = [prompts[i % len(prompts)] for i in range(args.batch_prompts)]
        t0 = time.perf_counter()
        say(f"building the batched engine ({args.batch_slots} slots) ...")
        many = SpecEngine(model, drafter, stop, slots=args.batch_slots, max_len=max_len, **engine_kw)
        warm(many, batch_prompts, max_len, args.batch_slots)
        say(f"batched: {args.batch_slots} slots, warm-up {time.perf_counter() - t0:.1f} s")
        reference = {tuple(p): g.tokens for (_, p), g in zip(prompts, greedy)}
        for overlap in modes:
            many.overlap_rounds = overlap
            key = "batched" if overlap == modes[0] else "batched_sequential"
            results[key] = {"slots": args.batch_slots,
                            **batched(many, batch_prompts, args.max_new_tokens, device, reference)}
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        say(f"wrote {args.out}")
    return results


def static_engine_supported(model) -> bool:
    """Batched runs need the static engine (the Hugging Face fallback is batch 1)."""
    try:
        check_supported(model)
    except UnsupportedModelError as exc:
        say(f"batched runs skipped: {exc}")
        return False
    return True


def report(results: dict) -> None:
    rows = []
    for suffix in ("", "_sequential"):
        if "batch1" + suffix not in results:
            continue
        b1, tag = results["batch1" + suffix], suffix.replace("_", " ")
        g, s = b1["greedy"], b1["spec"]
        rows += [
            (f"batch 1 greedy{tag}", f"{g['tok_s']:.1f} tok/s", f"{g['ms_per_round']['total']:.3f} ms/token"),
            (f"batch 1 speculative{tag}", f"{s['tok_s']:.1f} tok/s", f"tau {s['tau']}"),
            (f"speedup (wall clock){tag}", f"{b1['speedup']:.3f}x", f"{b1['speedup_over_tau']} x tau"),
            (f"ms per spec round{tag}", f"draft {s['ms_per_round']['draft']}",
             f"verify {s['ms_per_round']['verify']}, host {s['ms_per_round']['host']}"),
            (f"lossless{tag}", f"{b1['lossless']['identical']} identical",
             f"{b1['lossless']['near_tie']} near-tie, {b1['lossless']['mismatch']} mismatch"),
        ]
    for suffix in ("", "_sequential"):
        if "batched" + suffix in results:
            bt, tag = results["batched" + suffix], suffix.replace("_", " ")
            rows += [(f"batched greedy ({bt['slots']} slots){tag}", f"{bt['greedy']['committed_tok_s']:.1f} tok/s", ""),
                     (f"batched speculative ({bt['slots']} slots){tag}", f"{bt['spec']['committed_tok_s']:.1f} tok/s",
                      f"tau {bt['spec']['tau']}, speedup {bt['speedup']}x = {bt['speedup_over_tau']} x tau")]
    width = max(len(r[0]) for r in rows)
    say("\n" + "\n".join(f"{a:<{width}}  {b:<22}  {c}" for a, b, c in rows))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
