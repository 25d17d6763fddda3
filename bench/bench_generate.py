"""Throughput of the built-in generate engine against Hugging Face `generate`.

    # on a GPU (bf16, CUDA graphs, with and without torch.compile):
    python bench/bench_generate.py --out runs/bench_generate.json
    # on CPU, tiny settings (checks the script, not the speed):
    python bench/bench_generate.py --device cpu --threads 1 --slots 2,4 --new-tokens 8 --hf-batch 4 --hf-new-tokens 4
    # no model file: --random-init uses random weights of SmolLM2-135M's shape

For each slot count the engine decodes `rows-per-slot x slots` fixed chat prompts, greedy,
ignoring EOS so every row makes exactly `--new-tokens` tokens (finished slots are refilled
from the queue, as in a real run). Reported per configuration: new tok/s over the whole run
(prefill included), decode-only tok/s, prefill tok/s and ms per decode step.

Hugging Face `generate` runs at `--hf-batch` rows x `--hf-new-tokens` (left padded, greedy,
min_new_tokens = max_new_tokens) as the baseline. Its tokens also serve as a correctness
check of the engine on this device: `hf_agreement_*` is the fraction of rows whose first
`--hf-new-tokens` tokens are identical in both (1.0 expected in fp32; in bf16 a few rows may
drift apart after a near-tie, since batch shapes change rounding; a low value means a bug).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dflash_train.utils.device import sync

QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the ocean at night.",
    "Explain how a rainbow forms in simple terms.",
    "Give me three tips for learning a new language.",
    "How do I reverse a list in Python?",
    "What are the main causes of climate change?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a healthy breakfast for a busy morning.",
    "How does a bicycle stay upright?",
    "Write a haiku about autumn leaves.",
    "What is machine learning?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "How do vaccines work?",
]

# SmolLM2-135M-Instruct's architecture, for --random-init when the model file is absent.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def load(args, dtype, device):
    """(model, tokenizer or None, description)."""
    from dflash_train.target.loading import load_causal_lm, load_tokenizer

    if args.random_init:
        from transformers import LlamaConfig, LlamaForCausalLM

        try:
            tokenizer = load_tokenizer(args.model)
        except FileNotFoundError:
            tokenizer = None
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(dtype=dtype, device=device).eval()
        model.requires_grad_(False)  # as load_causal_lm leaves a target
        return model, tokenizer, "random-init SmolLM2-135M architecture"
    try:
        tokenizer = load_tokenizer(args.model)
        model = load_causal_lm(args.model, dtype=dtype, device=device)
    except FileNotFoundError as exc:
        sys.exit(f"{exc}\n(pass --random-init to benchmark a randomly initialised model of the same shape)")
    return model, tokenizer, str(args.model)


def make_prompts(tokenizer, n: int, vocab: int) -> list[list[int]]:
    """n fixed prompts: the chat-templated QUESTIONS, or random ids without a tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        base = [torch.randint(3, vocab, (int(k),), generator=gen).tolist() for k in torch.randint(30, 60, (len(QUESTIONS),), generator=gen)]
    else:
        base = []
        for q in QUESTIONS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            base.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [base[i % len(base)] for i in range(n)]



def run_engine(model, prompts, *, slots, new_tokens, cuda_graphs, compile, device):
    from dflash_train.generate.builtin import BuiltinEngine, EngineStats
    from dflash_train.generate.engine import Request

    max_prompt = max(map(len, prompts))
    t_build = time.perf_counter()
    engine = BuiltinEngine(
        model, None, slots=slots, max_prompt_tokens=max_prompt, max_new_tokens=new_tokens,
        stop_ids=set(), ignore_eos=True, cuda_graphs=cuda_graphs, compile=compile,
    )  # fmt: skip

    def go(batch):
        queue = iter([Request(prompt_ids=p, max_new_tokens=new_tokens, tag=i) for i, p in enumerate(batch)])
        out: dict[int, list[int]] = {}
        engine.run(lambda: next(queue, None), lambda r, c: out.__setitem__(r.tag, c.token_ids))
        return out

    # Warm-up: compiles, captures the CUDA graphs of the buckets the timed run will use.
    go(prompts[:slots])
    sync(device)
    setup_s = time.perf_counter() - t_build
    engine.stats = EngineStats()
    t0 = time.perf_counter()
    out = go(prompts)
    sync(device)
    seconds = time.perf_counter() - t0
    st = engine.stats
    return out, {
        "slots": slots,
        "cuda_graphs": engine.step.use_graphs,
        "compile": compile and device.type == "cuda",
        "rows": len(prompts),
        "new_tokens": st.new_tokens,
        "seconds": round(seconds, 3),
        "new_tok_s": round(st.new_tokens / seconds, 1),
        "decode_tok_s": round((st.new_tokens - st.completed) / max(st.decode_seconds, 1e-9), 1),
        "prefill_tok_s": round(st.prompt_tokens / max(st.prefill_seconds, 1e-9), 1),
        "prefill_seconds": round(st.prefill_seconds, 3),
        "decode_steps": st.decode_steps,
        "ms_per_step": round(1000 * st.decode_seconds / max(st.decode_steps, 1), 3),
        "slot_utilisation": round(st.slot_steps_active / max(st.decode_steps * slots, 1), 3),
        "setup_seconds": round(setup_s, 1),
        "kv_cache_gib": round(engine.decoder.kv_bytes() / 2**30, 3),
    }


def run_hf(model, prompts, new_tokens, device):
    """Hugging Face generate, left padded, greedy, exactly `new_tokens` per row."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, -4:], attention_mask=mask[:, -4:], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        sync(device)
    seconds = time.perf_counter() - t0
    rows = out[:, width:].tolist()
    return rows, {"batch": len(prompts), "new_tokens_per_row": new_tokens, "seconds": round(seconds, 3),
                  "new_tok_s": round(len(prompts) * new_tokens / seconds, 1)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin", help="'builtin', a model directory or a .gguf file")
    ap.add_argument("--random-init", action="store_true", help="random weights with SmolLM2-135M's shape")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--slots", default="64,128,256", help="comma-separated slot counts")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rows-per-slot", type=int, default=2, help="rows = this x slots (refills happen)")
    ap.add_argument("--compile", choices=["both", "on", "off"], default="both", help="torch.compile (GPU only)")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    model, tokenizer, what = load(args, dtype, device)
    vocab = model.config.vocab_size
    report: dict = {
        "model": what, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": dtype_name, "torch": torch.__version__, "new_tokens_per_row": args.new_tokens, "results": [],
    }  # fmt: skip
    import transformers

    report["transformers"] = transformers.__version__
    print(f"{what} on {report['device']} ({dtype_name}), torch {torch.__version__}", flush=True)

    compiles = {"both": [False, True], "on": [True], "off": [False]}[args.compile] if device.type == "cuda" else [False]
    for slots in [int(s) for s in args.slots.split(",")]:
        prompts = make_prompts(tokenizer, slots * args.rows_per_slot, vocab)
        for compile in compiles:
            try:
                _, res = run_engine(model, prompts, slots=slots, new_tokens=args.new_tokens,
                                      cuda_graphs=not args.no_cuda_graphs, compile=compile, device=device)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - report the failure, keep measuring the others
                res = {"slots": slots, "compile": compile, "error": f"{type(exc).__name__}: {exc}"}
            report["results"].append(res)
            print(json.dumps(res), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if not args.no_hf:
        prompts = make_prompts(tokenizer, args.hf_batch, vocab)
        hf_rows, hf = run_hf(model, prompts, args.hf_new_tokens, device)
        # the engine's tokens for the same prompts, in every compile mode measured
        for compile in compiles:
            eng_out, _ = run_engine(model, prompts, slots=min(args.hf_batch, 64), new_tokens=args.hf_new_tokens,
                                    cuda_graphs=not args.no_cuda_graphs, compile=compile, device=device)  # fmt: skip
            same = [eng_out[i] == hf_rows[i] for i in range(len(prompts))]
            prefix = [next((k for k, (a, b) in enumerate(zip(eng_out[i], hf_rows[i])) if a != b), args.hf_new_tokens)
                      for i in range(len(prompts))]  # fmt: skip
            tag = "compiled" if compile else "uncompiled"
            hf[f"hf_agreement_{tag}"] = round(sum(same) / len(same), 3)
            hf[f"mean_common_prefix_{tag}"] = round(sum(prefix) / len(prefix), 2)
        report["hf_generate"] = hf
        ok = [r for r in report["results"] if "new_tok_s" in r]
        if ok:
            best = max(ok, key=lambda r: r["new_tok_s"])
            report["best"] = {k: best[k] for k in ("slots", "compile", "new_tok_s")}
            report["speedup_vs_hf"] = round(best["new_tok_s"] / hf["new_tok_s"], 1)
        print(json.dumps({"hf_generate": hf, "speedup_vs_hf": report.get("speedup_vs_hf")}), flush=True)

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
