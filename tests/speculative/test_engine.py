"""The static speculative engine (speculative/engine.py) against Hugging Face and the slow
reference decoder (speculative/loop.py), token for token and round for round (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate import graphs
from dflash_train.generate.decoder import StaticDecoder
from dflash_train.generate.layers import q_writing_kv as _q_writing_kv
from dflash_train.speculative.decoders import HFSpecDecoder, bf16_ulp, first_divergence, make_spec_decoder
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.decoders import make_proposer
from dflash_train.speculative.loop import DecodeResult, Round, SpeculativeDecoder
from dflash_train.speculative.static_drafter import StaticDrafter, _block_q
from dflash_train.target.chat_template import stop_token_ids as stop_tokens

from ..eval.conftest import ScriptedProposer, plain_greedy, random_drafter

NEW = 40


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop) or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_taps(model, ids: list[int], layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] and taps [T, n*H] (hidden_states[l + 1]) of one HF forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in layers], -1)


class OracleDrafts:
    """A DraftSource test double: like tests/eval's ScriptedProposer, per slot. Round r of a
    prompt proposes its true greedy continuation (`references[prompt]`) for the first
    pattern[r % len] drafts, then surely wrong tokens."""

    def __init__(self, references: dict[tuple, list[int]], block_size: int, pattern: list[int], vocab: int):
        self.references, self.block_size, self.pattern, self.vocab = references, block_size, pattern, vocab
        self.target_layer_ids = [1, 3]
        self.slot: dict[int, list] = {}  # slot -> [reference, prompt length, rounds proposed]

    def start(self, ids, lengths, slot_ids, taps) -> None:
        assert taps.shape[:2] == ids.shape
        for row, n, slot in zip(ids.tolist(), lengths.tolist(), slot_ids.tolist()):
            self.slot[slot] = [self.references[tuple(row[:n])], n, 0]

    def extend(self, taps, start) -> None:
        pass

    def propose(self, tokens, positions, kv_len) -> torch.Tensor:
        drafts = torch.zeros(tokens.shape[0], self.block_size - 1, dtype=torch.long)
        for slot, pos in enumerate(positions.tolist()):
            if slot not in self.slot:
                continue
            ref, n, r = self.slot[slot]
            self.slot[slot][2] += 1
            done = max(pos - n + 1, 0)  # output tokens committed so far
            truth = ref[done:done + self.block_size - 1]
            truth += [0] * (self.block_size - 1 - len(truth))
            m = self.pattern[r % len(self.pattern)]
            drafts[slot] = torch.tensor([t if k < m else (t + 1) % self.vocab for k, t in enumerate(truth)])
        return drafts


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_verify_equals_hf_forward(kind, targets):
    """Prefill and two verify rounds for 3 slots at different positions: logits and taps equal
    the HF forward of each slot's sequence; the second round starts inside the first block, so
    the stale cache entries of its rejected tail must be masked and overwritten."""
    model, _ = targets[kind]
    vocab, layers, T = model.config.vocab_size, [0, 2, 4], 4
    dec = StaticDecoder(model, slots=3, max_len=128)
    prompts = random_prompts(vocab, (9, 3, 20))
    slots = [2, 0, 1]
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        last, taps = dec.prefill_with_taps(ids, lengths, torch.tensor(slots), layers)
    seqs = {}
    for r, (p, s) in enumerate(zip(prompts, slots)):
        ref_logits, ref_taps = hf_taps(model, p, layers)
        torch.testing.assert_close(last[r], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(taps[r, :len(p)], ref_taps, atol=1e-4, rtol=1e-4)
        seqs[s] = list(p)
    kept = {0: 1, 1: 4, 2: 2}  # tokens of the first block each slot keeps
    g = torch.Generator().manual_seed(5)
    for round_ in range(2):
        blocks = torch.randint(4, vocab, (3, T), generator=g)
        positions = torch.tensor([len(seqs[s]) for s in range(3)])
        with torch.no_grad():
            logits, taps = dec.verify(blocks, positions, 64, layers)
        assert logits.shape == (3, T, vocab) and taps.shape == (3, T, 3 * model.config.hidden_size)
        for s in range(3):
            ref_logits, ref_taps = hf_taps(model, seqs[s] + blocks[s].tolist(), layers)
            torch.testing.assert_close(logits[s], ref_logits[-T:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(taps[s], ref_taps[-T:], atol=1e-4, rtol=1e-4)
            seqs[s] += blocks[s].tolist()[:kept[s]] if round_ == 0 else []


@pytest.mark.parametrize("sliding,causal_full", [(None, False), (None, True), (3, False), (3, True)])
def test_static_proposal_equals_slow_proposer(sliding, causal_full, targets):
    """3 slots at different positions, context written in engine-like rounds (blocks whose
    uncommitted tail holds garbage taps): drafts equal DFlashProposer's, hidden states too."""
    model, tok = targets["qwen3"]
    B = 6
    drafter = random_drafter(model, tok, B, layers=3, sliding=sliding, causal_full=causal_full)
    cfg = drafter.config
    proposer = make_proposer(drafter, model)
    embed = model.get_input_embeddings().weight
    static = StaticDrafter(drafter, embed, embed, slots=3, max_len=64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, cfg.vocab_size, (3, 40), generator=g)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], -1)  # [3, 40, n*H]
    anchors = [5, 17, 30]  # each slot's last committed token position
    rows = torch.arange(3)
    with torch.no_grad():
        static.start(ids[:, :4], torch.full((3,), 4), rows, taps[:, :4])
        committed = [4, 4, 4]  # context is valid below this position
        while committed != anchors:
            step = [min(int(torch.randint(1, B + 1, (1,), generator=g)), a - c) for a, c in zip(anchors, committed)]
            block = torch.randn(3, B, taps.shape[-1], generator=g) * 5  # garbage past the committed tokens
            for s in range(3):
                block[s, :step[s]] = taps[s, committed[s]:committed[s] + step[s]]
            static.extend(block, torch.tensor(committed))
            committed = [c + k for c, k in zip(committed, step)]
        tokens, positions = ids[rows, anchors], torch.tensor(anchors)
        hidden = static.block_hidden(tokens, positions, 64)
        drafts = static.propose(tokens, positions, 64)
    for s, p in enumerate(anchors):
        proposer.start()
        proposer.extend(taps[s, :p], torch.arange(p))
        torch.testing.assert_close(hidden[s], proposer.block_hidden(int(tokens[s]), p), atol=1e-5, rtol=1e-5)
        assert drafts[s].tolist() == proposer.propose(ids[s, :p + 1].tolist(), p)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_speculative_equals_greedy_equals_hf(kind, targets):
    """Batch 1, random DFlash drafters of several block sizes: the engine's speculative and
    plain greedy outputs equal HF greedy decoding, its rounds equal the slow decoder's, and
    the greedy margins are HF's top-1 minus top-2 logits."""
    model, tok = targets[kind]
    vocab = model.config.vocab_size
    stop = stop_tokens(tok, model)
    chat = tok.apply_chat_template([{"role": "user", "content": "count from three"}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = random_prompts(vocab, (1, 40)) + [tok(chat, add_special_tokens=False)["input_ids"]]
    references = [hf_greedy(model, p, NEW, stop) for p in prompts]
    for B, sliding, causal_full in [(2, None, False), (4, 3, False), (8, None, True)]:
        drafter = random_drafter(model, tok, B, sliding=sliding, causal_full=causal_full)
        slow_proposer = make_proposer(drafter, model, copy_drafter=True)
        engine = SpecEngine(model, drafter, stop, slots=1, max_len=128)
        with SpeculativeDecoder(model, drafter.config.target_layer_ids, stop) as slow:
            for prompt, ref in zip(prompts, references):
                spec = engine.generate(prompt, NEW)
                greedy = engine.generate(prompt, NEW, speculative=False)
                assert spec.tokens == greedy.tokens == ref
                assert spec.rounds == slow.generate(prompt, NEW, slow_proposer).rounds
                assert spec.finish_reason == greedy.finish_reason == ("stop" if ref[-1] in stop else "length")
                assert greedy.rounds == [Round(0, 0, 1)] * (len(ref) - 1)
                assert spec.margins is None and len(greedy.margins) == len(greedy.top_logits) == len(ref)
    logits, _ = hf_taps(model, prompts[-1] + references[-1], [0])  # `greedy` is the last prompt's
    top = logits[len(prompts[-1]) - 1:-1].topk(2, dim=-1).values
    torch.testing.assert_close(torch.tensor(greedy.top_logits), top[:, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(greedy.margins), top[:, 0] - top[:, 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_scripted_drafts_rounds_equal_slow_decoder(kind, targets):
    """Forced-correct drafts (all accepted: tau = B), forced-wrong and partial ones: the same
    tokens and the same rounds (drafted / accepted / committed) as the slow decoder with the
    same script; a stop token inside accepted drafts and max_new_tokens cut the commit."""
    model, _ = targets[kind]
    vocab, layers = model.config.vocab_size, [1, 3]
    prompt = random_prompts(vocab, (7,))[0]
    for B in (3, 8):
        n = 6 * B + 1  # prefill 1 + 6 rounds of B
        ref = plain_greedy(model, layers, set(), prompt, n).tokens
        stop_at = next(i for i in range(5, n) if ref[i] not in ref[:i] and 1 <= i % B <= B - 2)
        for stop, max_new in [(set(), n), (set(), 10), ({ref[stop_at]}, n)]:
            for pattern in ([B - 1], [0], [B - 1, 0, 1, B - 2]):
                engine = SpecEngine(model, OracleDrafts({tuple(prompt): ref}, B, pattern, vocab), stop, max_len=128)
                fast = engine.generate(prompt, max_new)
                with SpeculativeDecoder(model, layers, stop) as slow:
                    expect = slow.generate(prompt, max_new, ScriptedProposer(ref, len(prompt), B, pattern, vocab))
                assert fast.tokens == expect.tokens and fast.rounds == expect.rounds
                assert fast.finish_reason == expect.finish_reason
        # the last case: stopped inside a block, drafts past the stop token accepted but not committed
        assert fast.tokens == ref[:stop_at + 1] and fast.finish_reason == "stop"
    oracle = SpecEngine(model, OracleDrafts({tuple(prompt): ref}, 8, [7], vocab), set(), max_len=128)
    assert oracle.generate(prompt, n).tau == 8
    limited = SpecEngine(model, OracleDrafts({tuple(prompt): ref}, 4, [3], vocab), set(), max_len=128)
    assert limited.generate(prompt, 10).rounds == [Round(3, 3, 4), Round(3, 3, 4), Round(0, 0, 1)]


class RecordingStatic:
    """Scripted drafts decide the rounds (many accepted), while the real StaticDrafter runs
    alongside on the same context and its own proposals are recorded."""

    def __init__(self, static: StaticDrafter, script: OracleDrafts):
        self.static, self.script, self.recorded = static, script, []
        self.block_size, self.target_layer_ids = static.block_size, static.target_layer_ids

    def start(self, ids, lengths, slot_ids, taps) -> None:
        self.static.start(ids, lengths, slot_ids, taps)
        self.script.start(ids, lengths, slot_ids, taps)

    def extend(self, taps, start) -> None:
        self.static.extend(taps, start)

    def propose(self, tokens, positions, kv_len):
        self.recorded.append(self.static.propose(tokens, positions, kv_len)[0].tolist())
        return self.script.propose(tokens, positions, kv_len)


class RecordingSlow:
    """The same on the slow path: ScriptedProposer drafts, DFlashProposer proposals recorded."""

    def __init__(self, dflash, script: ScriptedProposer):
        self.dflash, self.script, self.recorded = dflash, script, []
        self.block_size = dflash.block_size

    def start(self) -> None:
        self.dflash.start()
        self.script.start()

    def extend(self, taps, positions) -> None:
        self.dflash.extend(taps, positions)

    def propose(self, sequence, position):
        self.recorded.append(self.dflash.propose(sequence, position))
        return self.script.propose(sequence, position)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_drafter_context_through_multi_token_commits(kind, targets):
    """With rounds committing 1..B tokens, the engine's drafter context (extend at each block's
    start, tails overwritten) gives the real drafter the very proposals the slow decoder's
    DFlashProposer makes from the committed taps, round after round."""
    model, tok = targets[kind]
    vocab, B, pattern = model.config.vocab_size, 4, [3, 0, 1, 2, 3, 3]
    prompt = random_prompts(vocab, (9,))[0]
    drafter = random_drafter(model, tok, B, layers=2, sliding=3, causal_full=True)
    layers = drafter.config.target_layer_ids
    ref = plain_greedy(model, layers, set(), prompt, NEW).tokens
    embed = model.get_input_embeddings().weight
    fast_source = RecordingStatic(StaticDrafter(drafter, embed, embed, slots=1, max_len=128),
                                  OracleDrafts({tuple(prompt): ref}, B, pattern, vocab))
    fast = SpecEngine(model, fast_source, set(), max_len=128).generate(prompt, NEW)
    slow_source = RecordingSlow(make_proposer(drafter, model, copy_drafter=True),
                                ScriptedProposer(ref, len(prompt), B, pattern, vocab))
    with SpeculativeDecoder(model, layers, set()) as slow_decoder:
        slow = slow_decoder.generate(prompt, NEW, slow_source)
    assert fast.tokens == slow.tokens == ref and fast.rounds == slow.rounds
    assert {r.committed for r in fast.rounds} == {1, 2, 3, 4}
    # the engine also proposes in a last round with one token left, where the slow path does not
    assert len(slow_source.recorded) <= len(fast_source.recorded) <= len(slow_source.recorded) + 1
    assert fast_source.recorded[: len(slow_source.recorded)] == slow_source.recorded


def test_batched_commits_what_batch_one_commits(targets):
    """7 prompts of different lengths through 3 (and 4) slots, refilled as rows finish at
    different rounds: every prompt's tokens, rounds and finish reason equal batch 1's, with
    the real static drafter, with scripted drafts and in plain greedy mode."""
    model, tok = targets["llama"]
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, (12, 1, 30, 5, 21, 2, 9), seed=4)
    free_run = {tuple(p): plain_greedy(model, [0], set(), p, NEW).tokens for p in prompts}
    # a stop token early in as many outputs as possible but absent from some: rows end at
    # different rounds, some by the stop token, some by the limit
    absent_somewhere = {t for out in free_run.values() for t in out} - set.intersection(*map(set, free_run.values()))
    stop = {max(absent_somewhere, key=lambda t: (sum(t in out[: NEW // 2] for out in free_run.values()), -t))}
    drafter = random_drafter(model, tok, 4, sliding=3)
    sources = {
        "dflash": lambda: drafter,
        "scripted": lambda: OracleDrafts(free_run, 4, [3, 0, 1, 2], vocab),
        "greedy": lambda: None,
    }
    finish_reasons = set()
    for name, make in sources.items():
        one = SpecEngine(model, make(), stop, slots=1, max_len=128)
        expected = [one.generate(p, NEW, speculative=name != "greedy") for p in prompts]
        finish_reasons |= {r.finish_reason for r in expected}
        for slots, refill in [(3, 0.125)] + ([(4, 0.5)] if name == "scripted" else []):  # (4, 0.5): refills wait for 2
            many = SpecEngine(model, make(), stop, slots=slots, max_len=128, refill_fraction=refill)
            got = many.generate_batch(prompts, NEW, speculative=name != "greedy")
            for e, r in zip(expected, got):
                assert (r.tokens, r.rounds, r.finish_reason) == (e.tokens, e.rounds, e.finish_reason), name
                if name == "greedy":  # the same decisions; the logits round a little differently per batch shape
                    assert r.margins == pytest.approx(e.margins, abs=1e-4)
                else:
                    assert r.margins is None
    assert finish_reasons == {"stop", "length"}


def test_capture_protocol_replays_each_step_exactly_once(targets, monkeypatch):
    """What a CUDA-graph capture does to a step, emulated on CPU: two warm-up runs (state
    restored after each), then replays. Captures happen mid-run, whenever a round first needs
    a bigger kv bucket; the output must not change."""
    model, tok = targets["qwen3"]
    drafter = random_drafter(model, tok, 4, sliding=3)
    prompts = random_prompts(model.config.vocab_size, (100, 20, 3), seed=6)  # 100 + 40 crosses the 128 bucket
    captured = []

    def emulated_capture(step, kv_len):
        step.warm_up(kv_len)
        captured.append((step.name, kv_len))
        return type("Graph", (), {"replay": lambda self: step.fn(kv_len)})(), None  # (graph, its outputs)

    monkeypatch.setattr(graphs.GraphedStep, "_capture", emulated_capture)
    plain = SpecEngine(model, drafter, set(), slots=2, max_len=256)
    graphed = SpecEngine(model, drafter, set(), slots=2, max_len=256)
    for step in graphed._steps():
        step.use_graphs = True
    for speculative in (True, False):
        expected = plain.generate_batch(prompts, NEW, speculative=speculative)
        got = graphed.generate_batch(prompts, NEW, speculative=speculative)
        assert [(r.tokens, r.rounds) for r in got] == [(r.tokens, r.rounds) for r in expected]
    assert sorted(captured) == sorted((name, kv) for name in ("draft", "verify", "greedy") for kv in (128, 256))


def test_prefill_is_a_captured_step_per_padded_chunk_shape(targets, monkeypatch):
    """The prefill is a captured step per padded chunk shape (rows and tokens a row each a power
    of two; at batch 1 one row): the same tokens and rounds as an uncaptured multi-slot engine,
    one capture per (mode, shape) actually used, and none again when a later chunk has the same
    shape."""
    model, tok = targets["llama"]
    drafter = random_drafter(model, tok, 4)
    prompts = random_prompts(model.config.vocab_size, (100, 20, 3, 33), seed=8)
    captured = []

    def emulated_capture(step, shape):
        step.fn(shape)
        captured.append((step, shape))
        return type("Graph", (), {"replay": lambda self: step.fn(shape)})(), None

    monkeypatch.setattr(graphs.GraphedStep, "_capture", emulated_capture)
    eager = SpecEngine(model, drafter, set(), slots=2, max_len=256)
    one = SpecEngine(model, drafter, set(), slots=1, max_len=256)
    assert (one.prefill.shapes.widths, one.prefill.shapes.rows) == ([32, 64, 128, 256], [1])
    many = SpecEngine(model, drafter, set(), slots=3, max_len=256, refill_fraction=0.5)
    assert many.prefill.shapes.rows == [1, 2, 3]
    for step in [*one._prefill_steps.values(), *many._prefill_steps.values()]:
        step.use_graphs = True
    for speculative in (True, False):
        expected = eager.generate_batch(prompts, NEW, speculative=speculative)
        for engine in (one, many):
            got = engine.generate_batch(prompts, NEW, speculative=speculative)
            assert [(r.tokens, r.rounds) for r in got] == [(r.tokens, r.rounds) for r in expected]
            for r, e in zip(got, expected):  # padding changes fp32 summation order: margins agree to rounding
                assert (r.margins is None) == (e.margins is None)
                if r.margins is not None:
                    assert r.margins == pytest.approx(e.margins, abs=1e-4)
    assert len(captured) == len(set(captured))  # a step captures a shape once
    shapes = lambda engine: {shape for step, shape in captured if step in engine._prefill_steps.values()}  # noqa: E731
    assert shapes(one) == {(1, 32), (1, 64), (1, 128)}
    # 3 slots: the first three prompts (100, 20, 3 tokens) in one chunk of 3 rows, 128 tokens a row
    assert (3, 128) in shapes(many) and all(rows in (1, 2, 3) for rows, _ in shapes(many))


def test_compiled_layer_functions_trace_once_and_match(targets):
    """The GPU path compiles the per-layer functions; on CPU, with a non-fusing backend: one
    graph per function and step width, reused by every layer, slot count and round."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, tok = targets["llama"]
    drafter = random_drafter(model, tok, 4, sliding=3)
    prompts = random_prompts(model.config.vocab_size, (9, 30), seed=7)
    expected = SpecEngine(model, drafter, set(), slots=2, max_len=128).generate_batch(prompts, 24)
    torch._dynamo.reset()
    counters.clear()
    engine = SpecEngine(model, drafter, set(), slots=2, max_len=128)
    engine._compile_layer_functions(backend="aot_eager")
    assert engine.decoder.q_writing_kv is not _q_writing_kv and engine.drafter.block_q is not _block_q
    got = engine.generate_batch(prompts, 24)
    assert [(r.tokens, r.rounds) for r in got] == [(r.tokens, r.rounds) for r in expected]
    # at widths B and 1: target pre/post attention, final logits, the commit (8); drafter block
    # q/k/v, context k/v, post attention, head (4)
    assert counters["stats"]["unique_graphs"] == 12


def test_factory_falls_back_for_unsupported_targets(targets):
    model, tok = targets["llama"]
    drafter = random_drafter(model, tok, 4)
    stop = stop_tokens(tok, model)
    prompt = random_prompts(model.config.vocab_size, (6,))[0]
    fast = make_spec_decoder(model, drafter.to(torch.float64), stop, max_len=128)
    assert isinstance(fast, SpecEngine)
    assert drafter.fc.weight.dtype == torch.float64  # the engine runs a converted copy; the caller's is unchanged
    drafter.float()
    model.config.hidden_act = "gelu"  # check_supported refuses it
    try:
        slow = make_spec_decoder(model, drafter, stop, max_len=128)
    finally:
        model.config.hidden_act = "silu"
    assert isinstance(slow, HFSpecDecoder)
    try:
        for speculative in (True, False):
            a = fast.generate(prompt, 12, speculative=speculative)
            b = slow.generate(prompt, 12, speculative=speculative)
            assert (a.tokens, a.rounds) == (b.tokens, b.rounds)
    finally:
        slow.close()  # its forward hooks stay on the shared model otherwise


def test_divergence_classification():
    assert bf16_ulp(1.0) == 2**-7 and bf16_ulp(1.99) == 2**-7 and bf16_ulp(16.0) == 0.125
    assert bf16_ulp(-3.0) == 2**-6 and bf16_ulp(9.0) == 2**-4 and bf16_ulp(0.0) == 0.0
    ref = DecodeResult([5, 6, 7, 8], [], "length", 1.0, 0.1, margins=[1.0, 0.2, 0.5, 3.0],
                       top_logits=[10.0, 20.0, -17.0, 9.0])
    same = first_divergence([5, 6, 7, 8], ref)
    assert (same.position, same.margin, same.kind) == (None, None, "identical")
    tie = first_divergence([5, 9, 1], ref)  # |20| in [16, 32): ulp 1/8, tolerance 4 ulps
    assert (tie.position, tie.margin, tie.tolerance, tie.kind) == (1, 0.2, 0.5, "near_tie")
    edge = first_divergence([5, 6, 1, 1], ref)
    assert (edge.position, edge.margin, edge.tolerance, edge.kind) == (2, 0.5, 0.5, "near_tie")
    real = first_divergence([5, 6, 7, 1], ref)  # |9| in [8, 16): ulp 1/16
    assert (real.position, real.margin, real.tolerance, real.kind) == (3, 3.0, 0.25, "mismatch")
    assert first_divergence([5, 6, 7, 1], ref, tolerance=3.0).kind == "near_tie"
    assert first_divergence([5, 6, 7, 1], ref, ulps=48).kind == "near_tie"  # 48/16 = 3.0
    assert first_divergence([5, 6, 7, 1], ref, ulps=47).kind == "mismatch"
    short = first_divergence([5, 6], ref)
    assert (short.position, short.margin, short.kind) == (2, None, "mismatch")
    bare = first_divergence([4], DecodeResult([5], [], "length", 1.0, 0.1))
    assert (bare.position, bare.margin, bare.kind) == (0, None, "mismatch")
