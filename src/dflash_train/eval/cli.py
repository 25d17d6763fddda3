"""Measure a drafter by real speculative decoding.

    dflash-train eval --target PATH --drafter DIR --prompts builtin|humaneval|FILE

Greedy speculative decoding of every prompt with KV caches for target and drafter, and
plain greedy decoding through the same code for comparison. Writes report.json and
report.png (see docs/eval.md) and prints the summary.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from dflash_train.data.prompts import load_prompts, prompt_set_name
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.config import mismatches_with_target
from dflash_train.eval.report import cpu_cost_line, plot_report, summary_lines, write_json
from dflash_train.speculative.decoders import NEAR_TIE_ULPS
from dflash_train.speculative.evaluate import build_report, evaluate_prompts, measure_batched
from dflash_train.target.attn_impl import AttnImplementation, resolve_attn_implementation
from dflash_train.target.loading import load_causal_lm, load_config, load_tokenizer, resolve_model_source
from dflash_train.train.export_cli import find_drafter_dir
from dflash_train.utils.config import cli
from dflash_train.utils.device import DtypeName, choose_cpu_threads, resolve_device, resolve_dtype
from dflash_train.utils.errors import ModelError
from dflash_train.utils.fs import check_output_dir, check_writable_dir, write_marker

log = logging.getLogger(__name__)


@dataclass
class EvalJobConfig:
    drafter: str = ""
    """exported drafter directory (or a training run / checkpoint directory)"""
    target: str = "builtin"
    """model directory, .gguf file, or 'builtin' (SmolLM2-135M-Instruct)"""
    prompts: str = "builtin"
    """'builtin' (= 'chat': held-out chat prompts), 'humaneval', or a JSONL/JSON file"""
    num_prompts: int = 0
    """use only the first N prompts (0 = all)"""
    max_new_tokens: int = 256
    """tokens generated per prompt"""
    max_prompt_tokens: int = 4096
    """longer prompts are skipped"""
    greedy: bool = True
    """also decode plain greedy: the speedup and the lossless check (--no-greedy: twice as fast)"""
    strict: bool = False
    """exit with status 1 if an output differs from plain greedy decoding at a clear margin (a
    mismatch); divergences at a near-tie of the target's top two logits (see --near-tie-ulps) are
    expected in bf16 and only reported"""
    near_tie_ulps: float = NEAR_TIE_ULPS
    """a divergence is a near-tie when the greedy run's top-1 minus top-2 logit there is at most this
    many bf16 units in the last place of the top-1 logit (docs/eval.md)"""
    timing_repeats: int = 3
    """decode every prompt this many times in both modes: the speedup is their median, with its spread
    (the outputs and tau come from the first)"""
    batch_size: int = 0
    """also measure batched decoding: this many prompts at once, committed tokens/s (0 = off)"""
    slots: int = 1
    """decode this many prompts at once for the report itself: tau and the outputs in a fraction of the
    time, for comparing drafters (needs --no-greedy: a shared batch's timings are no batch-1 speedups;
    tau equals batch 1's, in bf16 up to near-ties)"""
    draft_window: int = 0
    """decode the drafter's full-attention layers with this sliding window, so that drafting cost stays
    flat on long contexts (drafts change, outputs never do; 0 = the drafter's own attention: docs/eval.md)"""
    compile: bool = True
    """torch.compile the engine's per-layer functions (GPU only; slower start, faster decoding)"""
    overlap_rounds: bool = True
    """launch each speculative round before the previous one is read back (docs/eval.md, "Pipelined
    rounds"); --no-overlap-rounds: one round at a time, the same outputs and rounds"""
    output: str | None = field(default=None, metadata=cli(aliases=("-o",)))
    """report directory (default runs/eval/<drafter>-<prompts>)"""
    overwrite: bool = False
    """replace the report directory when an earlier eval wrote it (else an existing one is refused)"""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda, cuda:N"""
    dtype: DtypeName = "auto"
    """auto = bfloat16 on GPU, float32 on CPU"""
    threads: int = 0
    """CPU threads for torch (0: the cores other processes leave idle)"""
    trust_remote_code: bool = False
    """let transformers run code shipped with the target"""
    attn_implementation: AttnImplementation = "auto"
    """the target's attention: auto = sdpa where the model supports it, else eager (Gemma 2, gpt-oss);
    a choice the model does not support is refused before it loads"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        if not self.drafter:
            raise ValueError("--drafter DIR is required")
        if self.max_new_tokens < 1 or self.num_prompts < 0 or self.max_prompt_tokens < 1 or self.threads < 0:
            raise ValueError("max_new_tokens and max_prompt_tokens must be >= 1, num_prompts and threads >= 0")
        if self.timing_repeats < 1:
            raise ValueError("timing_repeats must be >= 1")
        if self.near_tie_ulps < 0 or self.batch_size < 0 or self.draft_window < 0:
            raise ValueError("near_tie_ulps, batch_size and draft_window must be >= 0")
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.slots > 1 and self.greedy:
            raise ValueError("--slots N measures tau and the outputs only: add --no-greedy (speedups are batch 1's)")
        if self.strict and not self.greedy:
            raise ValueError("--strict checks every output against plain greedy decoding, which --no-greedy leaves "
                             "out: drop one of the two")


CONFIG = EvalJobConfig
ATTN_OPTION = "attn-implementation"  # how error messages name the option


def run(cfg: EvalJobConfig, args: argparse.Namespace | None = None) -> int:
    prompts = load_prompts(cfg.prompts, cfg.num_prompts or None)
    drafter_dir = find_drafter_dir(cfg.drafter)
    out = Path(cfg.output) if cfg.output else Path("runs/eval") / f"{drafter_dir.name}-{prompt_set_name(cfg.prompts)}"
    out = check_output_dir(out, overwrite=cfg.overwrite, inputs=(cfg.drafter, drafter_dir), job="eval")  # checked now
    drafter = load_drafter(drafter_dir)
    source = resolve_model_source(cfg.target)
    target_config = load_config(source, trust_remote_code=cfg.trust_remote_code)
    problems = mismatches_with_target(drafter.config, target_config)
    if problems:  # from the configs alone, before the target's weights load
        raise ModelError("the drafter does not fit this target: " + "; ".join(problems))
    resolve_attn_implementation(target_config, cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code,
                                option=ATTN_OPTION)  # an unsupported choice: refused before any prompt is decoded
    check_writable_dir(out)  # before any prompt is decoded, not after all of them
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu":
        threads, why = choose_cpu_threads(cfg.threads)
        log.info("CPU threads: %d (%s)", threads, why)
    log.info("target %s (%s, %s) | drafter %s (block %d) | %d prompts from %s", source.describe(), dtype, device,
             drafter_dir, drafter.config.block_size, len(prompts), cfg.prompts)
    tokenizer = load_tokenizer(source, trust_remote_code=cfg.trust_remote_code)
    target = load_causal_lm(source, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code,
                            attn_implementation=cfg.attn_implementation, attn_option=ATTN_OPTION)
    compile = cfg.compile and device.type == "cuda"
    results = evaluate_prompts(target, tokenizer, drafter, prompts, max_new_tokens=cfg.max_new_tokens,
                               greedy=cfg.greedy, max_prompt_tokens=cfg.max_prompt_tokens, progress=cfg.progress,
                               near_tie_ulps=cfg.near_tie_ulps, compile=compile, timing_repeats=cfg.timing_repeats,
                               draft_window=cfg.draft_window or None, slots=cfg.slots,
                               overlap_rounds=cfg.overlap_rounds)
    report = build_report(results, drafter.config.block_size, target=source.describe(), drafter=str(drafter_dir),
                          prompts=cfg.prompts, max_new_tokens=cfg.max_new_tokens, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), near_tie_ulps=cfg.near_tie_ulps,
                          draft_window=cfg.draft_window or None, slots=cfg.slots, overlap_rounds=cfg.overlap_rounds,
                          torch=torch.__version__, transformers=transformers.__version__)
    if cfg.batch_size:
        log.info("batched decoding: %d prompts, %d at once ...", len(prompts), cfg.batch_size)
        report["batched"] = measure_batched(target, tokenizer, drafter, prompts, slots=cfg.batch_size,
                                            max_new_tokens=cfg.max_new_tokens, greedy=cfg.greedy, compile=compile,
                                            draft_window=cfg.draft_window or None,
                                            overlap_rounds=cfg.overlap_rounds)
    write_marker(out, "eval")  # so that a later `eval --overwrite` may replace it
    json_path = write_json(report, out / "report.json")
    png_path = plot_report(report, out / "report.png", title=f"{drafter_dir.name} on {prompt_set_name(cfg.prompts)}")
    print("\n".join(summary_lines(report)))
    if device.type == "cpu" and (cost := cpu_cost_line(report)):  # why a CPU's speedup is below 1
        print(cost)
    print(f"report: {json_path}\nfigure: {png_path}")
    kinds = report["overall"].get("divergences", {})
    if kinds.get("mismatch"):
        log.warning("%d outputs differ from plain greedy decoding at a clear margin (mismatch): a bug; "
                    "see per_prompt[].divergence in %s", kinds["mismatch"], json_path)
        if cfg.strict:
            return 1
    return 0
