"""Train NVIDIA Model-Optimizer's DFlash drafter on our training conversations, as a peer of
`dflash-train train` (docs/peer-comparison.md).

    PYTHONPATH=<site with nvidia-modelopt>:src python bench/peer_modelopt/train_peer.py \
        --target HF_DIR --data gen/train.jsonl --output OUT (--minutes N | --tokens N)

Our own launcher around the peer's public API: the target loads with transformers, the
drafter is added by `mtsp.convert(model, [("dflash", ...)])` (peer_setup.py: our drafter's
shape on this target), a plain transformers Trainer trains it (the peer's training forward:
anchors, masks, KD loss with D-PACE weights) and `export_speculative_decoding` writes it to
OUT/export. Then `bench/peer_modelopt/convert.py OUT/export DIR` makes it our checkpoint.

The data: the same conversations, rendered by our ChatRenderer (same tokens, same loss mask:
assistant content + end-of-turn marker), one conversation per row right-padded to --seq-len
(the peer does not pack), labels -100 off the loss mask (the peer's answer-only convention).

Budgets: --minutes stops the loop after that many minutes of training (wall clock on one
GPU: GPU-seconds = training seconds); --tokens stops once that many real (non-padding) tokens
went through the drafter, counted like our trainer's `tokens` (PackedBatch.num_tokens: every
non-padding position of every row of every step). The learning-rate schedule is the peer's
(linear warm-up, then linear decay to 0), fitted to the budget: its end is re-estimated from
the measured step rate (minutes) or tokens per step (tokens), as `run.fit_schedule` does ours.

Output: progress lines with timestamps, OUT/export (the peer's export + peer_run.json) and a
final line `SUMMARY {json}` (steps, tokens, seconds, loss), also written to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub (the peer's validation would)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from peer_setup import PEER_PACKAGE, convert_to_peer_dflash, dflash_settings, draft_rope_theta, stub_missing_pulp  # noqa: E402

IGNORE = -100  # transformers' label ignore index, which the peer reads as "not in the loss"


def stamp(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model: a Hugging Face folder")
    p.add_argument("--data", required=True, help="training conversations (JSONL with `messages`, as gen/train.jsonl)")
    p.add_argument("--output", required=True, help="new directory for the run")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="training wall-clock budget (one GPU)")
    budget.add_argument("--tokens", type=int, help="training budget in real tokens through the drafter")
    p.add_argument("--seq-len", type=int, default=4096, help="row length, a multiple of the block (the peer's "
                   "recipe: 4096); longer conversations are cut")
    p.add_argument("--batch-size", type=int, default=2, help="rows per step (2 x 4096 positions = one of our "
                   "8192-token rows; the peer's recipe: 1)")
    p.add_argument("--num-anchors", type=int, default=512, help="anchors per row (ours: 512 per row)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (the peer's recipe: 6e-4)")
    p.add_argument("--warmup-steps", type=int, default=100, help="the peer's recipe: 100")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="auto: on with CUDA")
    a = p.parse_args(argv)
    if a.seq_len % a.block_size:
        p.error(f"--seq-len {a.seq_len} must be a multiple of --block-size {a.block_size} (the peer requires it)")
    if (a.minutes is not None and a.minutes <= 0) or (a.tokens is not None and a.tokens <= 0):
        p.error("the budget must be positive")
    return a


def load_rows(path: str, tokenizer, seq_len: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """(input_ids, loss_mask) per conversation, cut to seq_len; DataError names file:line on bad rows."""
    from dflash_train.data.render import ChatRenderer
    from dflash_train.data.sources import iter_records

    renderer = ChatRenderer(tokenizer)
    rows, cut, dropped, records = [], 0, 0, list(iter_records([path]))
    for encoded in renderer.encode_records(records):
        if isinstance(encoded, Exception):
            raise encoded
        for ids, mask in encoded:
            cut += len(ids) > seq_len
            ids, mask = torch.as_tensor(ids[:seq_len], dtype=torch.long), torch.as_tensor(mask[:seq_len])
            if not bool(mask[1:].any()):
                dropped += 1  # nothing left to learn after the cut (the peer needs an anchor in the loss)
                continue
            rows.append((ids, mask))
    real = [len(ids) for ids, _ in rows]
    stats = {"conversations": len(records), "rows": len(rows), "rows_cut": cut, "rows_dropped": dropped,
             "real_tokens": sum(real), "mean_row_tokens": sum(real) / max(len(real), 1)}
    return rows, stats


class PaddedRows(torch.utils.data.Dataset):
    def __init__(self, rows, seq_len: int, pad_id: int):
        self.rows, self.seq_len, self.pad_id = rows, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.rows[i]
        n, S = len(ids), self.seq_len
        input_ids = torch.full((S,), self.pad_id, dtype=torch.long)
        input_ids[:n] = ids
        attention = torch.zeros(S, dtype=torch.long)
        attention[:n] = 1
        labels = torch.full((S,), IGNORE, dtype=torch.long)
        labels[:n] = torch.where(mask, ids, torch.full_like(ids, IGNORE))
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


class Budget:
    """Stop rule and fitted schedule length for --minutes / --tokens."""

    def __init__(self, args, mean_row_tokens: float):
        self.minutes, self.tokens_goal = args.minutes, args.tokens
        self.warmup = args.warmup_steps
        self.tokens, self.steps, self.t0 = 0, 0, None
        self.rate_from = (5, None)  # (step, time): steps before it hold the first-step overheads
        per_step = args.batch_size * mean_row_tokens
        self.planned = math.ceil(self.tokens_goal / per_step) if self.tokens_goal else 10 ** 9

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 is not None else 0.0

    def step_done(self, batch_tokens: int) -> bool:
        """Count a finished step; True when the budget is spent."""
        self.steps += 1
        self.tokens += batch_tokens
        if self.steps == self.rate_from[0]:
            self.rate_from = (self.steps, time.perf_counter())
        if self.tokens_goal:
            self.planned = max(self.steps, math.ceil(self.tokens_goal / (self.tokens / self.steps)))
            return self.tokens >= self.tokens_goal
        left = self.minutes * 60 - self.seconds()
        if self.rate_from[1] is not None and self.steps > self.rate_from[0]:
            per_step = (time.perf_counter() - self.rate_from[1]) / (self.steps - self.rate_from[0])
            self.planned = self.steps + max(0, int(left / per_step))
        return left <= 0

    def lr_factor(self, step: int) -> float:
        """The peer's schedule (transformers' linear): warm-up, then linear to 0 at `planned`."""
        if step < self.warmup:
            return (step + 1) / max(1, self.warmup)
        return max(0.0, (self.planned - step) / max(1, self.planned - self.warmup))


def make_trainer(model, dataset, args, budget: Budget, out: Path):
    import transformers

    class PeerTrainer(transformers.Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, budget.lr_factor)
            return self.lr_scheduler

        def training_step(self, model, inputs, *rest, **kw):
            loss = super().training_step(model, inputs, *rest, **kw)
            self._batch_tokens = int(inputs["attention_mask"].sum())
            return loss

    class Progress(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if budget.step_done(trainer._batch_tokens):
                control.should_training_stop = True

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                secs = budget.seconds()
                stamp(f"step {state.global_step}/{budget.planned} tokens {budget.tokens} loss {logs['loss']:.4f} "
                      f"lr {logs.get('learning_rate', 0):.2e} {budget.tokens / max(secs, 1e-9):.0f} tok/s "
                      f"{secs:.0f}s")

    use_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and torch.cuda.is_available())
    targs = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        warmup_steps=args.warmup_steps, lr_scheduler_type="linear", weight_decay=0.0, max_steps=10 ** 9,
        bf16=use_bf16, tf32=torch.cuda.is_available(), logging_steps=args.log_every, save_strategy="no",
        report_to="none", remove_unused_columns=False, dataloader_drop_last=True, seed=args.seed,
        disable_tqdm=True, do_eval=False)
    trainer = PeerTrainer(model=model, args=targs, train_dataset=dataset, callbacks=[Progress()])
    trainer._batch_tokens = 0
    return trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty; choose a new directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    stub_missing_pulp()
    import transformers
    from modelopt.torch.export import export_speculative_decoding

    from dflash_train.drafter.config import default_target_layer_ids
    from dflash_train.target.loading import choose_mask_token_id
    from dflash_train.utils.errors import DFlashError

    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    try:
        rows, data_stats = load_rows(args.data, tokenizer, args.seq_len)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(rows) < args.batch_size:
        print(f"error: {args.data}: {len(rows)} usable rows, fewer than --batch-size {args.batch_size}", file=sys.stderr)
        return 2
    stamp(f"data: {json.dumps(data_stats)}")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    text_cfg = model.config.get_text_config()
    mask_id = choose_mask_token_id(tokenizer, int(text_cfg.vocab_size))  # what our trainer picks
    taps = default_target_layer_ids(int(text_cfg.num_hidden_layers), args.num_layers)
    settings = dflash_settings(text_cfg, mask_token_id=mask_id, block_size=args.block_size,
                               num_layers=args.num_layers, target_layer_ids=taps, num_anchors=args.num_anchors)
    convert_to_peer_dflash(model, settings)
    n_params = sum(p.numel() for p in model.dflash_module.parameters())
    stamp(f"peer drafter: {n_params / 1e6:.2f}M parameters, taps {taps}, mask {mask_id}, "
          f"rope theta {draft_rope_theta(model)}, block {args.block_size}, anchors {args.num_anchors}")
    budget = Budget(args, data_stats["mean_row_tokens"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = make_trainer(model, PaddedRows(rows, args.seq_len, pad_id), args, budget, out)
    stamp(f"training: budget {args.minutes} min / {args.tokens} tokens, rows of {args.seq_len}, "
          f"batch {args.batch_size}, lr {args.lr}, warm-up {args.warmup_steps}, bf16 {trainer.args.bf16}")
    budget.t0 = time.perf_counter()
    result = trainer.train()
    train_s = budget.seconds()
    model.eval()
    export_dir = out / "export"
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(export_dir))
    record = {"peer": PEER_PACKAGE, "draft_rope_theta": draft_rope_theta(model), "settings": settings,
              "data": data_stats, "args": vars(args)}
    (export_dir / "peer_run.json").write_text(json.dumps(record, indent=2) + "\n")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gpus = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    summary = {"steps": budget.steps, "tokens": budget.tokens, "train_seconds": round(train_s, 1),
               "gpu_seconds": round(train_s * gpus, 1), "wall_seconds": round(time.perf_counter() - t_start, 1),
               "tok_per_s": round(budget.tokens / max(train_s, 1e-9), 1), "loss_last": losses[-1] if losses else None,
               "loss_mean": result.training_loss, "planned_steps": budget.planned, "export": str(export_dir),
               "device": torch.cuda.get_device_name(0) if gpus else "cpu",
               "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpus else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
