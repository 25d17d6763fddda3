"""The built-in engine against Hugging Face greedy decoding, token for token (CPU, fp32)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch

from dflash_train.generate import builtin
from dflash_train.generate.builtin import BuiltinEngine, decode_rows
from dflash_train.generate.decoder import UnsupportedModelError, check_supported
from dflash_train.generate.layers import pre_attention as _pre_attention
from dflash_train.generate.layers import q_writing_kv as _q_writing_kv
from dflash_train.generate.engine import Completion, Request
from dflash_train.speculative.evaluate import HeldOutProbe
from dflash_train.target.fp8 import convert_decoder_linears

from .tiny import make_model

NEW = 20


def hf_greedy(model, prompt: list[int], eos: int | None) -> list[int]:
    """Hugging Face greedy decoding of one unpadded prompt (no padding ambiguity)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
        eos_token_id=eos, pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    return out[: out.index(eos)] if eos is not None and eos in out else out


def pick_eos(outputs: list[list[int]]) -> int:
    """A token the model really produces, at as many different first positions as possible,
    so that rows stop at different steps."""
    first_positions: dict[int, set[int]] = defaultdict(set)
    for out in outputs:
        seen = set()
        for i, t in enumerate(out):
            if t not in seen:
                seen.add(t)
                first_positions[t].add(i)
    return max(first_positions, key=lambda t: (len(first_positions[t]), -t))


def run_engine(engine: BuiltinEngine, requests: list[Request]) -> dict[int, Completion]:
    queue = iter(requests)
    results: dict[int, Completion] = {}
    engine.run(lambda: next(queue, None), lambda req, comp: results.__setitem__(req.tag, comp))
    return results


@pytest.mark.parametrize("kind,attention", [("llama", "dense"), ("qwen2", "dense"), ("qwen3", "dense"),
                                            ("llama", "flex"), ("qwen3", "flex"), ("qwen3_moe", "dense"),
                                            ("qwen3_moe", "flex")])
def test_equals_hf_greedy_with_rows_finishing_at_different_steps(kind, attention):
    model = make_model(kind, vocab=256, seed=1)
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 24, (10,), generator=gen)]
    eos = pick_eos([hf_greedy(model, p, None) for p in prompts])
    expected = [hf_greedy(model, p, eos) for p in prompts]
    assert len({len(e) for e in expected}) >= 3, "the test needs rows that stop at different steps"

    # 3 slots for 10 prompts: finished slots are refilled while the others keep decoding
    engine = BuiltinEngine(model, None, slots=3, max_prompt_tokens=32, max_new_tokens=NEW, stop_ids={eos},
                           attention=attention)
    assert engine.buckets == ([64] if attention == "dense" else [128])  # flex: whole 128-key blocks, one step
    results = run_engine(engine, [Request(prompt_ids=p, max_new_tokens=NEW, tag=i) for i, p in enumerate(prompts)])

    assert [results[i].token_ids for i in range(len(prompts))] == expected
    for i, e in enumerate(expected):
        assert results[i].finish_reason == ("length" if len(e) == NEW else "stop")
    assert engine.stats.completed == len(prompts)
    assert engine.stats.prompt_tokens == sum(map(len, prompts))


def test_chat_requests_per_request_limits_and_bad_prompts(tokenizer):
    model = make_model("llama", vocab=len(tokenizer), seed=3)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = BuiltinEngine(model, tokenizer, slots=2, max_prompt_tokens=80, max_new_tokens=12)
    assert eot in engine.stop_ids
    chats = [[{"role": "user", "content": q}] for q in ("Name three fruits.", "What is gravity?", "Sort a list.")]
    reqs = [Request(messages=c, max_new_tokens=5 + i, tag=i) for i, c in enumerate(chats)]
    reqs.append(Request(messages=[{"role": "user", "content": "very long " * 40}], tag="long"))
    reqs.append(Request(text="<|im_start|>user\n", max_new_tokens=3, tag="text"))
    results = run_engine(engine, reqs)

    assert "prompt has" in results["long"].error and results["long"].finish_reason == "error"
    for i, chat in enumerate(chats):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        model.generation_config.eos_token_id = None
        want = hf_greedy(model, prompt, eot)[: 5 + i]
        assert results[i].token_ids == want
        assert results[i].text == tokenizer.decode(want)
        assert results[i].prompt_tokens == len(prompt)
    assert len(results["text"].token_ids) <= 3


def test_prompts_tokenised_in_one_call_equal_one_by_one(tokenizer):
    model = make_model("llama", vocab=len(tokenizer), seed=5)
    engine = BuiltinEngine(model, tokenizer, slots=2, max_prompt_tokens=80, max_new_tokens=4)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list, please."}]
    reqs = [Request(messages=chat), Request(prompt_ids=[7, 8, 9]), Request(text="<|im_start|>user\n"),
            Request(messages=[{"role": "user", "content": "What is gravity?"}])]
    one = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    template = lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
    want = [one(template(chat)), [7, 8, 9], one("<|im_start|>user\n"), one(template(reqs[3].messages))]
    assert engine.encode_many(reqs) == want
    assert [engine.encode(r) for r in reqs] == want
    assert engine.encode_many([]) == []
    with pytest.raises(ValueError, match="no tokenizer"):
        BuiltinEngine(model, None, slots=1, max_prompt_tokens=8, max_new_tokens=2, stop_ids=set()).encode_many(reqs[:1])


def test_rows_detokenised_in_one_call_equal_one_by_one(tokenizer):
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    texts = ["Name three fruits.", "<|im_start|>user\nhi<|im_end|>", " spaces  and\nnewlines ", ""]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] + [[3, 4, 5]]
    want = [tokenizer.decode(r, **kw) for r in rows]
    assert want[:4] == texts  # the byte-level tokenizer round-trips exactly
    assert decode_rows(tokenizer, rows) == want  # the Rust backend, one call

    class SlowTokenizer:  # no backend: one decode a row
        def decode(self, row, **kw):
            return ",".join(map(str, row)) + ("!" if kw == {"skip_special_tokens": False, "clean_up_tokenization_spaces": False} else "?")

    assert decode_rows(SlowTokenizer(), [[1, 2], [3]]) == ["1,2!", "3!"]
    assert decode_rows(tokenizer, []) == []


def test_prefill_forwards_follow_the_chunk_rule_and_host_time_is_split(monkeypatch):
    """Chunks are padded to bucket shapes (rows and width each a power of two, capped) and fill
    the token budget padded; a padding row repeats the chunk's first row, so its cache writes
    are that row's: the tokens stay plain greedy's."""
    monkeypatch.setattr(builtin, "PREFILL_MIN_WIDTH", 4)
    model = make_model("llama", vocab=256, seed=6)
    # lengths 2, 3, 5, 10, 20 under a 40-token budget, widths 4, 8, 16, 20, rows 1, 2, 4, 5:
    # [2, 3, 5] padded to 4 x 8 = 32 (adding 10 would make 4 x 16 = 64), then [10, 20] as 2 x 20
    prompts = [[5] * 10, [6] * 2, [7] * 20, [8] * 3, [9] * 5]
    engine = BuiltinEngine(model, None, slots=5, max_prompt_tokens=20, max_new_tokens=3, stop_ids=set(),
                           ignore_eos=True, prefill_tokens=40)
    assert (engine.prefill.shapes.widths, engine.prefill.shapes.rows) == ([4, 8, 16, 20], [1, 2, 4, 5])
    t0 = time.perf_counter()
    results = run_engine(engine, [Request(prompt_ids=p, tag=i) for i, p in enumerate(prompts)])
    wall = time.perf_counter() - t0
    model.generation_config.eos_token_id = None
    assert [results[i].token_ids for i in range(5)] == [hf_greedy(model, p, None)[:3] for p in prompts]
    st = engine.stats
    assert st.prefill_forwards == 2 and st.prompt_tokens == 40 and st.prefill_padded_tokens == 32 + 40
    assert st.completed == 5
    assert st.host_prefill_seconds > 0 and st.host_admit_seconds >= 0 and st.host_finish_seconds > 0
    assert st.host_admit_seconds + st.host_prefill_seconds + st.host_finish_seconds < wall


def test_each_prefill_shape_is_captured_once_and_counted(monkeypatch):
    """With CUDA graphs (a capture emulated on CPU: a replay reruns the step into the captured
    output), a chunk shape is captured on first use only; the stats count the shapes and the
    host's time capturing them, and the tokens stay plain greedy's."""
    shapes = []

    def emulated_capture(step, shape):
        time.sleep(0.001)
        shapes.append(shape)
        out = step.fn(shape)
        return type("Graph", (), {"replay": lambda self: out.copy_(step.fn(shape))})(), out

    monkeypatch.setattr(builtin.GraphedStep, "_capture", emulated_capture)
    monkeypatch.setattr(builtin, "PREFILL_MIN_WIDTH", 4)
    model = make_model("llama", vocab=256, seed=6)
    prompts = [[5] * 3, [6] * 2, [7] * 9, [8] * 3, [9] * 4, [4] * 2, [3] * 10]
    engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=16, max_new_tokens=3, stop_ids=set(),
                           ignore_eos=True, refill_fraction=1.0)
    engine.prefill_step.use_graphs = True
    results = run_engine(engine, [Request(prompt_ids=p, tag=i) for i, p in enumerate(prompts)])
    model.generation_config.eos_token_id = None
    assert [results[i].token_ids for i in range(len(prompts))] == [hf_greedy(model, p, None)[:3] for p in prompts]
    st = engine.stats
    assert len(shapes) == len(set(shapes)) == st.prefill_captures < st.prefill_forwards
    assert 0 < st.prefill_capture_seconds <= st.host_prefill_seconds


def test_ignore_eos_runs_every_row_to_the_limit():
    model = make_model("llama", vocab=256, seed=4)
    engine = BuiltinEngine(model, None, slots=4, max_prompt_tokens=8, max_new_tokens=9, stop_ids=set(range(256)), ignore_eos=True)
    results = run_engine(engine, [Request(prompt_ids=[5 + i, 7], max_new_tokens=9, tag=i) for i in range(6)])
    assert all(len(c.token_ids) == 9 and c.finish_reason == "length" for c in results.values())


def test_unsupported_architecture_points_to_http_engine():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="--engine http"):
        check_supported(model)


def test_fp8_target_is_refused_so_the_training_probe_is_skipped():
    """A target.fp8 training target has float8 decoder layers: the engine would fail on them
    (it reads each projection's bf16 weight), so check_supported refuses it and the trainer's
    held-out probe reports itself unavailable (a warning, not a crashed run)."""
    model = make_model("llama", vocab=256, seed=4)
    check_supported(model)
    convert_decoder_linears(model, model.model.layers)
    with pytest.raises(UnsupportedModelError, match="target.fp8"):
        check_supported(model)
    assert not HeldOutProbe(model, {0}, [[5, 7, 9]], max_new_tokens=8).available()


def test_compiled_layer_functions_trace_once_and_match():
    """The GPU path compiles the per-layer functions; check on CPU (with a backend that
    does not fuse) that they trace as one graph each, are reused by every layer and step
    without recompiling, and give the same tokens. Prefill stays eager: nothing of it is traced."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = make_model("qwen3", vocab=256, seed=6)
    # 3 slots: chunks of 3 rows x 4, then lone rows and pairs of widths 2-7 as slots free up
    prompts = [[3, 4, 5, 6], [9, 8], [20, 21], [5] * 7, [6, 6, 6], [1, 2, 3, 4, 5], [7, 7]]
    graphs: list[int] = []

    def tokens(compiled: bool):
        engine = BuiltinEngine(model, None, slots=3, max_prompt_tokens=8, max_new_tokens=6, stop_ids=set())
        if compiled:
            engine._compile_layer_functions(backend="aot_eager")
            assert engine.decoder.pre_attention is not _pre_attention  # the compiled one is in use
            graphs.append(counters["stats"]["unique_graphs"])
        reqs = [Request(prompt_ids=p, max_new_tokens=2 + i % 4, tag=i) for i, p in enumerate(prompts)]
        out = {i: c.token_ids for i, c in run_engine(engine, reqs).items()}
        if compiled:
            assert engine.stats.prefill_forwards >= 4  # chunks of several shapes went through the graphs
        return out

    torch._dynamo.reset()
    counters.clear()
    assert tokens(True) == tokens(False)
    # decode: pre_attention, post_attention
    assert graphs == [2] and counters["stats"]["unique_graphs"] == 2  # none traced during the run


def test_flex_decode_compiles_its_three_functions_once_and_matches_dense():
    """With flex attention a decode step is `verify` of one token: the compiled k/v-writing
    q, post-attention and logits head each trace once for the whole run (CPU, a backend that
    runs the traced graph as is), and the tokens equal the dense engine's."""
    import torch._dynamo

    model = make_model("llama", vocab=256, seed=6)
    prompts = [[3, 4, 5, 6], [9], [20, 21], [7, 7, 7]]
    traced: list[int] = []

    def recording_backend(gm, example_inputs):
        traced.append(len(gm.graph.nodes))
        return gm.forward

    def tokens(attention: str, compiled: bool):
        engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=8, max_new_tokens=6, stop_ids=set(),
                               attention=attention)
        if compiled:
            engine._compile_layer_functions(backend=recording_backend)
            assert engine.attention == "flex" and engine.decoder.q_writing_kv is not _q_writing_kv
            assert len(traced) == 3  # decode: q_writing_kv, post_attention, final_logits
        reqs = [Request(prompt_ids=p, max_new_tokens=6, tag=i) for i, p in enumerate(prompts)]
        return {i: c.token_ids for i, c in run_engine(engine, reqs).items()}

    dense = tokens("dense", False)
    torch._dynamo.reset()
    assert tokens("flex", True) == dense
    assert len(traced) == 3  # no recompilation during the run


def test_a_failing_compiler_falls_back_to_eager():
    model = make_model("llama", vocab=256, seed=7)
    engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=8, max_new_tokens=4, stop_ids=set())
    with pytest.warns(UserWarning, match="running it uncompiled"):
        engine._compile_layer_functions(backend="no-such-backend")
    assert engine.decoder.pre_attention is _pre_attention
    assert len(run_engine(engine, [Request(prompt_ids=[5, 6], max_new_tokens=4, tag=0)])[0].token_ids) == 4
    assert engine.attention == "dense"  # auto on a CPU


def test_a_failing_compiler_with_flex_falls_back_to_dense_attention():
    model = make_model("llama", vocab=256, seed=7)
    want = run_engine(BuiltinEngine(model, None, slots=2, max_prompt_tokens=8, max_new_tokens=4, stop_ids=set()),
                      [Request(prompt_ids=[5, 6], max_new_tokens=4, tag=0)])[0].token_ids
    engine = BuiltinEngine(model, None, slots=2, max_prompt_tokens=8, max_new_tokens=4, stop_ids=set(), attention="flex")
    with pytest.warns(UserWarning, match="uncompiled with dense attention"):
        engine._compile_layer_functions(backend="no-such-backend")
    assert engine.attention == engine.decoder.attention_kind == "dense"
    assert engine.decoder.q_writing_kv is _q_writing_kv
    assert run_engine(engine, [Request(prompt_ids=[5, 6], max_new_tokens=4, tag=0)])[0].token_ids == want


@pytest.mark.parametrize("slots", [1, 3])
def test_first_token_stops_limits_and_slots_refilled_under_a_step_in_flight(slots):
    """Rows that stop on their very first token, rows whose limit is 1, 2, ... and rows that
    run on, with every freed slot refilled at once (refill.min_free 1): the step launched before a
    row was seen to stop still carries a token for its slot, which must not reach the new row
    in that slot. Every row equals Hugging Face greedy up to its stop token or limit."""
    model = make_model("llama", vocab=256, seed=1)
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 24, (12,), generator=gen).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    full = [hf_greedy(model, p, None) for p in prompts]
    stops = {full[1][0], full[2][0]}  # rows 1 and 2 (and any other starting so) stop at once
    limits = [1, 2, 3, NEW, 1, 5, NEW, 2, NEW, 4, NEW, 7]
    expected = []
    for f, limit in zip(full, limits):
        cut = next((i for i, t in enumerate(f) if t in stops), NEW)
        expected.append((f[:cut], "stop") if cut < limit else (f[:limit], "length"))
    assert sum(e == ([], "stop") for e in expected) >= 2, "the test needs rows that stop at their first token"
    assert any(e[1] == "length" and len(e[0]) == 1 for e in expected)

    engine = BuiltinEngine(model, None, slots=slots, max_prompt_tokens=32, max_new_tokens=NEW, stop_ids=stops)
    assert engine.refill.min_free == 1
    stale, collect = [], engine._collect

    def spy(launched, on_complete):  # slots whose row changed since the step was launched
        row = engine.table.row
        stale.append(int(((launched.owners >= 0) & (launched.owners != row) & (row >= 0)).sum()))
        collect(launched, on_complete)

    engine._collect = spy
    results = run_engine(engine, [Request(prompt_ids=p, max_new_tokens=n, tag=i)
                                  for i, (p, n) in enumerate(zip(prompts, limits))])
    assert [(results[i].token_ids, results[i].finish_reason) for i in range(len(prompts))] == expected
    assert [results[i].new_tokens for i in range(len(prompts))] == [len(t) + (r == "stop") for t, r in expected]
    assert sum(stale) >= 3  # refilled slots had a step of their previous row in flight
    assert engine.table.n_active == 0 and sorted(engine.table.free) == list(range(slots))
    assert engine.stats.completed == len(prompts)
    assert engine.stats.new_tokens == sum(r.new_tokens for r in results.values())
