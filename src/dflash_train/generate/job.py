"""The generate job: the engine built and sized, an earlier run's rows read back, the driver run into
the output file, and the summary (generate/tasks.py says what the target is asked to write)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from tqdm import tqdm

from dflash_train.data.sources import Record, expand_inputs, iter_records
from dflash_train.generate.attention import decode_attention_for
from dflash_train.generate.builtin import BuiltinEngine
from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.decoder import check_supported_config
from dflash_train.generate.http_engine import HttpEngine
from dflash_train.generate.sizing import (KvShape, auto_slots, cache_positions, device_capacity_bytes, free_bytes,
                                          kv_shape, too_big)
from dflash_train.generate.tasks import (ANSWER_SETTINGS, STOP_ANNOUNCE, Driver, Resumed, conversation_id,
                                         normalize_prompt)
from dflash_train.generate.writer import JsonlAppender, read_rows, recover
from dflash_train.target.chat_template import user_header
from dflash_train.target.loading import load_causal_lm, load_config, load_tokenizer, resolve_model_source
from dflash_train.utils.device import choose_cpu_threads, resolve_device, resolve_dtype
from dflash_train.utils.errors import ConfigError, DataError, ModelError, OutputError
from dflash_train.utils.signals import StopSignals

log = logging.getLogger(__name__)


def build_engine(cfg: GenerateConfig, *, need_tokenizer: bool):
    """(engine, tokenizer or None) for the configured engine and target."""
    if cfg.engine == "http":
        engine = HttpEngine(
            cfg.base_url, cfg.model, concurrency=cfg.concurrency, retries=cfg.retries,
            backoff_s=cfg.retry_backoff_s, timeout_s=cfg.request_timeout_s,
        )  # fmt: skip
        return engine, (load_tokenizer(cfg.target) if need_tokenizer else None)

    source = resolve_model_source(cfg.target)
    tokenizer = load_tokenizer(source)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{source.describe()}: the tokenizer has no chat template; generate needs a chat model")
    max_new_tokens = max(cfg.max_new_tokens, cfg.prompt_max_tokens if cfg.synthesize else 1)
    # a family the engine cannot decode is refused from its config, before the weights load
    text_config = load_config(source).get_text_config()
    check_supported_config(text_config)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    shape = _kv_shape(cfg, text_config, device, dtype, max_new_tokens)
    if cfg.batch_size != "auto":  # a cache larger than the whole device: refused before the weights load
        _refuse_too_big(cfg.batch_size, shape, device_capacity_bytes(device), device, "whole")
    if device.type == "cpu":
        threads, why = choose_cpu_threads(0)
        log.info("CPU threads: %d (%s)", threads, why)
    model = load_causal_lm(source, dtype=dtype, device=device, attn_implementation=cfg.attn_implementation,
                           attn_option="attn-implementation")
    engine = BuiltinEngine(
        model, tokenizer, slots=_slots(cfg, shape, device), max_prompt_tokens=cfg.max_prompt_tokens,
        max_new_tokens=max_new_tokens, cuda_graphs=cfg.cuda_graphs, compile=cfg.compile, attention=cfg.attention,
        model_name=source.name or source.describe(),
    )  # fmt: skip
    return engine, tokenizer


def _kv_shape(cfg: GenerateConfig, text_config, device, dtype, max_new_tokens: int) -> KvShape:
    """One slot's cache, with the cache length the engine will choose (its attention's block size)."""
    shape = kv_shape(text_config, 1, dtype)
    attention = cfg.attention if cfg.attention != "auto" else decode_attention_for(device, cfg.compile,
                                                                                    [shape.head_dim])
    return kv_shape(text_config, cache_positions(cfg.max_prompt_tokens, max_new_tokens, attention), dtype, attention)


def _refuse_too_big(slots: int, shape: KvShape, available: int | None, device, which: str) -> None:
    """ConfigError when `slots` slots' cache exceeds `available` bytes: the device's `which` ("whole"
    or "free") memory; a CPU host's is its available memory either way."""
    where = f"the GPU's {which} memory" if device.type == "cuda" else "the host's available memory"
    problem = too_big(slots, shape, available, where)
    if problem is not None:
        raise ConfigError(problem)


def _slots(cfg: GenerateConfig, shape: KvShape, device) -> int:
    """The engine's slots: --batch-size, checked against the memory left after the model loaded, or
    what `auto` fits there (said in one line with the cache's size)."""
    free = free_bytes(device)
    if cfg.batch_size != "auto":
        _refuse_too_big(cfg.batch_size, shape, free, device, "free")
        return cfg.batch_size
    choice = auto_slots(shape, device, free)
    log.info("batch size auto: %d slots x %d positions, KV cache %.2f GiB (%s)", choice.slots, shape.positions,
             choice.kv_bytes / 2**30, choice.why)
    return choice.slots


def _count_prompt_rows(cfg: GenerateConfig, done_ids: set[str]) -> int:
    """Rows still to regenerate; reading them all first also finds malformed rows before
    any model is loaded."""
    todo = 0
    for record in iter_records(cfg.prompts, skip_bad=cfg.skip_bad, bad=[]):
        if record.messages is not None and conversation_id(record.file, record.line, record.messages) not in done_ids:
            todo += 1
    return todo


def engine_summary(stats: dict[str, float], slots: int) -> dict[str, float]:
    """The built-in engine's counters plus what they mean: ms per decode step, the share of
    slot-steps that decoded a live row, prefill and decode tok/s."""
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()}
    steps = stats.get("decode_steps", 0)
    if steps:
        out["ms_per_decode_step"] = round(1000 * stats["decode_seconds"] / steps, 3)
        if slots:
            out["slot_utilisation"] = round(stats["slot_steps_active"] / (steps * slots), 4)
    if stats.get("decode_seconds"):
        out["decode_tok_per_s"] = round(stats["slot_steps_active"] / stats["decode_seconds"], 1)
    if stats.get("prefill_seconds"):
        out["prefill_tok_per_s"] = round(stats["prompt_tokens"] / stats["prefill_seconds"], 1)
    return out


def round_robin_records(paths: list[str], *, skip_bad: bool, bad: list[DataError]) -> Iterator[Record]:
    """One row of each prompt file in turn (the files as `expand_inputs` orders them), until all
    are exhausted: a run stopped early has sampled every source, not only the first files."""
    live = [iter_records([path], skip_bad=skip_bad, bad=bad) for path in expand_inputs(paths)]
    while live:
        for it in list(live):
            record = next(it, None)
            if record is None:
                live.remove(it)
            else:
                yield record


def _check_prompts(cfg: GenerateConfig) -> None:
    """The prompt inputs exist, and (without --synthesize) hold a conversation to answer."""
    expand_inputs(cfg.prompts)
    if not cfg.synthesize and not any(r.messages is not None
                                      for r in iter_records(cfg.prompts, skip_bad=cfg.skip_bad, bad=[])):
        raise DataError(", ".join(map(str, cfg.prompts)), None, None,
                        "no prompt to answer (no conversation row; plain 'text' rows are skipped): nothing to generate")


def _rows_done(cfg: GenerateConfig) -> Resumed:
    """What an earlier run wrote to `cfg.output` (a resume)."""
    done = Resumed()
    synth_prefix = f"syn-{cfg.seed}-"
    for row in read_rows(cfg.output):
        done.rows += 1
        done.done_ids.add(row["id"])
        generator = row.get("generator")
        if isinstance(generator, dict):
            kept = {k: generator[k] for k in (*ANSWER_SETTINGS, "seed") if k in generator}
            done.generators.setdefault(json.dumps(kept, sort_keys=True), kept)
        if row.get("synthetic"):
            users = [m.get("content", "") for m in row.get("messages", []) if m.get("role") == "user"]
            if users:
                done.seen_prompts.add(normalize_prompt(users[0]))
            attempt = row["id"].removeprefix(synth_prefix)
            if row["id"].startswith(synth_prefix) and attempt.isdigit():
                done.synth_done += 1
                done.next_attempt = max(done.next_attempt, int(attempt) + 1)
    return done


def settings_changes(cfg: GenerateConfig, done: Resumed, model: str | None) -> list[str]:
    """`setting: X there vs Y now` for each answer setting in which rows already in the output differ
    from this run's (the model when it is known before it loads; the seed where either samples)."""
    ours: dict[str, Any] = {**cfg.answer_sampling.to_dict(), "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}
    if model is not None:
        ours["model"] = model
    changes = []
    for theirs in done.generators.values():
        sampled = theirs.get("temperature", 0) or cfg.temperature
        for key in (*ANSWER_SETTINGS, *(("seed",) if sampled else ())):
            if key in theirs and key in ours and theirs[key] != ours[key]:
                change = f"{key}: {theirs[key]!r} there vs {ours[key]!r} now"
                if change not in changes:
                    changes.append(change)
    return changes


def _model_name(cfg: GenerateConfig, engine) -> str | None:
    """The model name rows record, known before the model loads: a given engine's, the built-in engine's
    target's (as BuiltinEngine names it); None for a server not asked yet."""
    if engine is not None:
        return engine.describe().get("model")
    if cfg.engine == "builtin":
        source = resolve_model_source(cfg.target)
        return source.name or source.describe()
    return None


def _check_settings(cfg: GenerateConfig, done: Resumed, model: str | None) -> None:
    """An output whose rows were written with other answer settings is appended to only when asked."""
    changes = settings_changes(cfg, done, model)
    if not changes:
        return
    if not cfg.append_other_settings:
        raise OutputError(f"{cfg.output}: its {done.rows:,} rows were written with other settings ("
                          f"{'; '.join(changes)}): rerun with those settings to resume, choose another --output, or "
                          f"pass --append-other-settings to mix them in one file")
    log.warning("%s: appending with other settings than its rows' (%s): --append-other-settings", cfg.output,
                "; ".join(changes))


def _summary(cfg: GenerateConfig, driver: Driver, engine, bad: list[DataError], *, existing: int,
             seconds: float) -> dict[str, Any]:
    """The job's summary (and its warnings: malformed rows skipped, synthetic rows short)."""
    counts = driver.counts
    counts.bad_rows = len(bad)
    for err in bad[:5]:
        log.warning("skipped a malformed prompt row: %s", err)
    summary = {
        "output": cfg.output,
        "written": counts.written,
        "already_done": existing,
        "skipped_errors": counts.skipped_errors,
        "skipped_plain_text_rows": counts.skipped_text_rows,
        "skipped_bad_rows": counts.bad_rows,
        "synthetic_attempts": counts.synth_attempts,
        "rejected_prompts": counts.rejected_prompts,
        "new_tokens": counts.new_tokens,
        "seconds": round(seconds, 2),
        "new_tokens_per_second": round(counts.new_tokens / max(seconds, 1e-9), 1),
        "kept_tokens": counts.kept_tokens,
        "kept_tokens_per_second": round(counts.kept_tokens / max(seconds, 1e-9), 1),
        "stopped_by": driver.stopped_by,
    }
    stats = getattr(engine, "stats", None)
    if stats is not None:  # the built-in engine: where the time went
        summary["engine_stats"] = engine_summary(stats.as_dict(), getattr(engine, "slots", 0))
    if cfg.synthesize and driver.synth_have < cfg.synthesize:
        log.warning(
            "only %d of %d synthetic conversations after %d attempts (rejected: %s)",
            driver.synth_have, cfg.synthesize, counts.synth_attempts, counts.rejected_prompts,
        )  # fmt: skip
    return summary


def run_generate(cfg: GenerateConfig, *, engine=None, tokenizer=None, signals: StopSignals | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run the job; returns a summary. `engine`/`tokenizer` override building them (tests).

    Stops early, cleanly, on SIGINT/SIGTERM (recorded by `signals`, installed here unless
    given) or when `cfg.max_minutes` of the job have passed (`clock`): no new prompt is taken,
    the conversations started finish (every turn) and are written, and the summary says why (`stopped_by`)."""
    if signals is None:
        with StopSignals(announce=STOP_ANNOUNCE) as own:
            return run_generate(cfg, engine=engine, tokenizer=tokenizer, signals=own, clock=clock)
    job_start = clock()

    def should_stop() -> str | None:
        if signals.received:
            return signals.received
        if cfg.max_minutes and clock() - job_start >= cfg.max_minutes * 60:
            return f"max_minutes={cfg.max_minutes:g}"
        return None

    if cfg.prompts:
        _check_prompts(cfg)  # before the output file is touched
    made_here = not Path(cfg.output).exists()
    with JsonlAppender(cfg.output, flush_rows=cfg.flush_rows, flush_seconds=cfg.flush_seconds) as out:
        try:
            return _generate_into(out, cfg, engine=engine, tokenizer=tokenizer, should_stop=should_stop)
        except BaseException:
            if made_here:  # a run that failed before its first row leaves no empty output behind
                out.discard_if_empty()
            raise


def _generate_into(out: JsonlAppender, cfg: GenerateConfig, *, engine, tokenizer,
                   should_stop: Callable[[], str | None]) -> dict[str, Any]:
    """The job with its output open and locked: resume what is there, build the engine, run it."""
    recover(cfg.output)  # under the lock: no other run is appending
    done = _rows_done(cfg)
    _check_settings(cfg, done, _model_name(cfg, engine))
    if done.rows:
        log.info("%s: %d rows already done, resuming", cfg.output, done.rows)

    prompt_todo = _count_prompt_rows(cfg, done.done_ids) if cfg.prompts else 0
    todo = prompt_todo + max(0, cfg.synthesize - done.synth_done)
    if engine is None:
        engine, tokenizer = build_engine(cfg, need_tokenizer=cfg.synthesize > 0)
    header = user_header(tokenizer, cfg.system_prompt) if cfg.synthesize > 0 else None
    bad: list[DataError] = []
    records = None
    if cfg.prompts:
        records = round_robin_records(cfg.prompts, skip_bad=cfg.skip_bad, bad=bad) if cfg.mix \
            else iter_records(cfg.prompts, skip_bad=cfg.skip_bad, bad=bad)

    bar = tqdm(total=todo, unit="conv", dynamic_ncols=True, disable=not cfg.progress, desc="generate")
    t0 = time.perf_counter()
    last = [t0]
    # the bar's rate twice a second; without a bar (a batch job's log) a line now and then
    interval = 0.5 if cfg.progress else cfg.log_every_seconds

    def on_row(_tokens: int) -> None:
        bar.update(1)
        now = time.perf_counter()
        if not interval or now - last[0] < interval:
            return
        last[0] = now
        elapsed = max(now - t0, 1e-9)
        rate = f"{driver.counts.new_tokens / elapsed:,.0f} new tok/s ({driver.counts.kept_tokens / elapsed:,.0f} kept)"
        if cfg.progress:
            bar.set_postfix_str(rate)
        else:
            log.info("generate: %d of %d conversations written, %s, %.0f s", driver.counts.written, todo, rate,
                     now - t0)

    driver = Driver(
        cfg, out.add, engine.describe(), done=done, records=records, records_total=prompt_todo, header=header,
        tokenizer=tokenizer, on_row=on_row, should_stop=should_stop,
    )  # fmt: skip
    try:
        engine.run(driver.next_request, driver.on_complete)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    return _summary(cfg, driver, engine, bad, existing=done.rows, seconds=seconds)
