"""Near-duplicate detection (against brute force) and the held-out split: prompt groups never on
both sides, near-duplicates of training rows dropped from eval, the cache."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_train.data import dedup, splits
from dflash_train.data.config import DataConfig
from dflash_train.data.dataset import TokenDataset
from dflash_train.data.splits import (
    SplitReport,
    compute_split,
    held_out_split,
    in_eval,
    open_data,
    prompt_and_answer,
    prompt_hashes,
)
from dflash_train.utils.errors import ConfigError

from ..conftest import build_tokenizer, prepare_dataset, synthetic_conversations

# ---------------------------------------------------------------- brute-force references

def ref_shingles(x: np.ndarray, n: int) -> set[tuple]:
    x = tuple(int(t) for t in x)
    if len(x) < n:
        return {x} if x else set()
    return {x[i:i + n] for i in range(len(x) - n + 1)}


def ref_jaccard(a: np.ndarray, b: np.ndarray, n: int) -> float:
    sa, sb = ref_shingles(a, n), ref_shingles(b, n)
    return len(sa & sb) / len(sa | sb) if sa and sb else 0.0


def mutate(x: np.ndarray, rate: float, rng: np.random.Generator, vocab: int) -> np.ndarray:
    y = x.copy()
    hit = rng.random(len(y)) < rate
    y[hit] = rng.integers(0, vocab, hit.sum())
    return y


# ---------------------------------------------------------------- dedup

@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shingles_and_jaccard_match_brute_force(n):
    rng = np.random.default_rng(n)
    seqs = [rng.integers(0, 6, rng.integers(0, 25)).astype(np.int32) for _ in range(80)]
    values, offsets = dedup.shingle_sets(seqs, n)
    sets = [values[offsets[i]:offsets[i + 1]] for i in range(len(seqs))]
    for s, x in zip(sets, seqs):
        assert len(s) == len(ref_shingles(x, n)) and np.all(np.diff(s.astype(np.float64)) > 0)
        assert np.array_equal(s, dedup.shingles(x, n))
    for i, j in itertools.combinations(range(len(seqs)), 2):
        assert dedup.jaccard(sets[i], sets[j]) == pytest.approx(ref_jaccard(seqs[i], seqs[j], n), abs=1e-12), (i, j)
    # a short sequence is one shingle: equal short sequences match, a prefix of a longer one does not
    short = np.array([4, 5], np.int32)
    assert dedup.jaccard(dedup.shingles(short, 3), dedup.shingles(short.copy(), 3)) == 1.0
    assert dedup.jaccard(dedup.shingles(short, 3), dedup.shingles(np.array([4, 5, 6]), 3)) == 0.0


def test_minhash_agreement_estimates_jaccard():
    rng = np.random.default_rng(0)
    pairs = [(x, mutate(x, rate, rng, 10_000)) for rate in np.linspace(0.0, 0.4, 30)
             for x in [rng.integers(0, 10_000, 300)]]
    values, offsets = dedup.shingle_sets([s for p in pairs for s in p], 3)
    sig = dedup.minhash(values, offsets, seed=1)
    errors = [np.mean(sig[2 * k] == sig[2 * k + 1]) - ref_jaccard(a, b, 3) for k, (a, b) in enumerate(pairs)]
    assert abs(np.mean(errors)) < 0.03 and np.max(np.abs(errors)) < 0.2  # sd at J = 0.5: 0.044


def test_lsh_shape_and_documented_miss_probability():
    assert dedup.lsh_shape(0.5) == (42, 3)
    assert dedup.miss_probability(0.5, 42, 3) == pytest.approx(0.00367, abs=1e-4)
    for t in (0.2, 0.3, 0.5, 0.8, 1.0):
        bands, rows = dedup.lsh_shape(t)
        assert bands * rows <= dedup.NUM_PERM and 1 - dedup.miss_probability(t, bands, rows) >= dedup.MIN_RECALL


@pytest.mark.parametrize("threshold,n", [(0.5, 3), (0.5, 5), (0.3, 2), (0.8, 4)])
def test_near_duplicate_of_matches_all_pairs_reference(threshold, n, monkeypatch):
    monkeypatch.setattr(dedup, "CHUNK_TOKENS", 2_000)  # several corpus chunks
    rng = np.random.default_rng(int(threshold * 10) + n)
    vocab = 500
    corpus = [rng.integers(0, vocab, rng.integers(1, 120)) for _ in range(300)]
    # planted: mutated copies of corpus items at similarities spread over [0, 1] (a token kept with
    # probability k keeps an n-gram with k^n: J ~ k^n / (2 - k^n)), plus unrelated queries
    keep = (2 * np.linspace(0.05, 1.0, 120) / (1 + np.linspace(0.05, 1.0, 120))) ** (1 / n)
    queries = [mutate(corpus[i], 1 - k, rng, vocab) for i, k in zip(rng.choice(len(corpus), 120, replace=False), keep)]
    queries += [rng.integers(0, vocab, rng.integers(0, 60)) for _ in range(40)]
    corpus_sets = [ref_shingles(c, n) for c in corpus]
    best = np.array([max((len(q & c) / len(q | c) if q and c else 0.0) for c in corpus_sets)
                     for q in (ref_shingles(x, n) for x in queries)])
    found = dedup.near_duplicate_of(queries, corpus, threshold=threshold, ngram=n, seed=3)
    assert not np.any(found & (best < threshold)), "a reported pair below the threshold"
    bands, rows = dedup.lsh_shape(threshold)
    sure = best >= threshold + 0.1  # missed with probability < 1e-4 each
    assert dedup.miss_probability(threshold + 0.1, bands, rows) < 1e-4
    assert np.all(found[sure]), np.flatnonzero(sure & ~found)
    near = (best >= threshold) & ~sure
    assert ((best < threshold) & (best > threshold - 0.2)).sum() >= 5 and near.sum() >= 3  # the test plants both
    assert np.array_equal(found, best >= threshold)  # this seed misses nothing (p > 0.99)


def test_near_duplicate_of_in_worker_processes_gives_the_same_answer():
    rng = np.random.default_rng(11)
    corpus = [rng.integers(0, 400, rng.integers(1, 90)) for _ in range(200)]
    queries = [mutate(corpus[i], rate, rng, 400) for i, rate in zip(rng.choice(200, 60, replace=False),
                                                                    np.linspace(0.0, 0.6, 60))]
    one = dedup.near_duplicate_of(queries, corpus, threshold=0.5, ngram=3, seed=4)
    assert one.any() and not one.all()
    for workers in (2, 3):  # slices of 100 / 66-67 items, each read by a spawned process
        assert np.array_equal(dedup.near_duplicate_of(queries, corpus, threshold=0.5, ngram=3, seed=4,
                                                      workers=workers), one)


def test_ignored_shingles_are_left_out_unless_nothing_is_left():
    boiler = np.arange(1000, 1012)
    a, b = np.concatenate([boiler, [1, 2, 3, 4]]), np.concatenate([boiler, [7, 8, 9, 10]])
    seqs = [np.concatenate([boiler, np.random.default_rng(i).integers(0, 900, 8)]) for i in range(20)]
    common = dedup.common_shingles(seqs, 3, min_fraction=0.5, min_count=10)
    assert len(common) == len(dedup.shingles(boiler, 3))  # the shared prefix, nothing else
    assert dedup.near_duplicate_of([a], [b], threshold=0.5, ngram=3, seed=0)[0]  # shared prefix dominates
    assert not dedup.near_duplicate_of([a], [b], threshold=0.5, ngram=3, seed=0, ignore=common)[0]
    # all boilerplate: compared on everything it has, so an identical copy still matches
    assert dedup.near_duplicate_of([boiler], [boiler.copy()], threshold=1.0, ngram=3, seed=0, ignore=common)[0]


# ---------------------------------------------------------------- the split, on in-memory datasets

class MemDataset:
    """TokenDataset-like: rows of (input_ids, loss_mask), a manifest, a path for the cache."""

    def __init__(self, path, rows):
        self.path, self.rows = path, rows
        self.lengths = np.array([len(ids) for ids, _ in rows], np.int32)
        self.manifest = {"content": [int(x) for ids, _ in rows for x in ids[:3]] + [len(rows)]}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


SYSTEM = np.arange(40_000, 40_012)  # a shared system prompt: boilerplate, must not make prompts alike
rng_tokens = np.random.default_rng(123)


def row(prompt: np.ndarray, answer: np.ndarray):
    ids = np.concatenate([SYSTEM, prompt, answer]).astype(np.int32)
    return ids, np.arange(len(ids)) >= len(SYSTEM) + len(prompt)


def fresh(n: int) -> np.ndarray:
    return rng_tokens.integers(0, 30_000, n)


def side(prompt: np.ndarray, seed: int, fraction: float) -> bool:
    h, _ = prompt_hashes([row(prompt, fresh(3))], np.arange(1))
    return bool(in_eval(h, seed, fraction)[0])


def test_prompt_and_answer():
    ids, mask = np.arange(10), np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], bool)
    prompt, answer = prompt_and_answer((ids, mask))
    assert prompt.tolist() == [0, 1, 2] and answer.tolist() == [3, 4, 7, 8, 9]
    prompt, answer = prompt_and_answer((ids, np.ones(10, bool)))  # a text row
    assert prompt.tolist() == [] and answer.tolist() == list(range(10))


def test_near_duplicates_of_training_rows_are_dropped_with_exact_counts(tmp_path):
    seed, fraction = 5, 0.3
    cfg = DataConfig(path="x", eval_fraction=fraction, dedup_threshold=0.5, dedup_ngram=3)
    prompts = [fresh(30) for _ in range(60)]
    eval_p = [p for p in prompts if side(p, seed, fraction)]
    train_p = [p for p in prompts if not side(p, seed, fraction)]
    rows = [row(p, fresh(40)) for p in prompts for _ in range(2)]  # two answers per prompt

    assert len(eval_p) >= 6 and len(train_p) >= 6

    def on_train_side(make):  # a new prompt from `make()` that the seeded hash puts in train
        while side(q := make(), seed, fraction):
            pass
        return q

    def one_token_changed(p):
        q = p.copy()
        q[rng_tokens.integers(len(q))] = rng_tokens.integers(30_000)
        return q
    # 3 eval prompts with a training prompt one token away (Jaccard 27/33 over 3-grams): 6 rows dropped
    rows += [row(on_train_side(lambda p=p: one_token_changed(p)), fresh(40)) for p in eval_p[:3]]
    # 1 eval prompt with a training prompt sharing its first 12 tokens (Jaccard ~0.2): kept
    rows += [row(on_train_side(lambda: np.concatenate([eval_p[3][:12], fresh(18)])), fresh(40))]
    # 2 eval rows whose answer a training row repeats with one token deleted (Jaccard 35/40): 2 rows dropped
    for k in (4, 5):
        answer = next(r for r in rows if np.array_equal(r[0][12:42], eval_p[k]))[0][42:]
        rows += [row(train_p[k], np.delete(answer, 20))]
    ds = MemDataset(tmp_path, rows)
    split = compute_split(cfg, seed, ds)
    r = split.report
    assert (r.rule, r.eval_groups, r.eval_rows) == ("prompt", len(eval_p), 2 * len(eval_p))
    assert (r.dropped_prompt_duplicates, r.dropped_answer_duplicates) == (6, 2)
    assert r.eval_rows_kept == 2 * len(eval_p) - 8 and r.train_rows == len(rows) - 2 * len(eval_p)
    assert len(split.eval_rows) == r.eval_rows_kept
    # without the check: the same groups, nothing dropped
    plain = compute_split(DataConfig(path="x", eval_fraction=fraction, dedup_threshold=0.0), seed, ds)
    assert plain.report.eval_rows_kept == plain.report.eval_rows == r.eval_rows
    assert set(split.eval_rows) < set(plain.eval_rows) and np.array_equal(split.train_rows, plain.train_rows)


def grouped_dataset(path, groups=50, rows_per_group=(1, 6), seed=0):
    g = np.random.default_rng(seed)
    rows = [row(p, fresh(20)) for p in (fresh(15) for _ in range(groups)) for _ in range(g.integers(*rows_per_group))]
    return MemDataset(path, [rows[i] for i in g.permutation(len(rows))])


def test_no_prompt_on_both_sides_and_seeded_determinism(tmp_path):
    ds = grouped_dataset(tmp_path, groups=200)
    cfg = DataConfig(path="x", eval_fraction=0.2)
    a, b, c = (compute_split(cfg, s, ds) for s in (1, 1, 2))
    assert np.array_equal(a.eval_rows, b.eval_rows) and np.array_equal(a.train_rows, b.train_rows)
    assert not np.array_equal(a.eval_rows, c.eval_rows)
    for split in (a, c):
        prompts = {side: {prompt_and_answer(ds[int(i)])[0].tobytes() for i in rows}
                   for side, rows in (("train", split.train_rows), ("eval", split.eval_rows))}
        assert not prompts["train"] & prompts["eval"]
        assert sorted(np.concatenate([split.train_rows, split.eval_rows]).tolist()) == list(range(len(ds)))
        assert 0.1 < len(split.eval_rows) / len(ds) < 0.3


def test_a_single_prompt_cannot_be_split(tmp_path):
    p = fresh(10)
    ds = MemDataset(tmp_path, [row(p, fresh(5)) for _ in range(20)])
    with pytest.raises(ConfigError, match="leaves no training samples"):
        compute_split(DataConfig(path="x", eval_fraction=0.1), 0, ds)


def test_cache_is_written_reused_and_invalidated(tmp_path, monkeypatch):
    ds = grouped_dataset(tmp_path)
    cfg = DataConfig(path="x", eval_fraction=0.2)
    first = held_out_split(cfg, 0, ds)
    assert first.report.cache == "written" and len(list((tmp_path / ".splits").glob("*.npz"))) == 1

    def no_compute(*args, **kwargs):
        raise AssertionError("recomputed")
    monkeypatch.setattr(splits, "compute_split", no_compute)
    again = held_out_split(cfg, 0, ds)
    assert again.report.cache == "hit" and again.report.eval_rows == first.report.eval_rows
    assert np.array_equal(again.eval_rows, first.eval_rows) and np.array_equal(again.train_rows, first.train_rows)
    for changed in (DataConfig(path="x", eval_fraction=0.2, dedup_threshold=0.7),
                    DataConfig(path="x", eval_fraction=0.2, dedup_ngram=4), DataConfig(path="x", eval_fraction=0.3)):
        with pytest.raises(AssertionError, match="recomputed"):
            held_out_split(changed, 0, ds)
    with pytest.raises(AssertionError, match="recomputed"):
        held_out_split(cfg, 1, ds)  # another seed
    monkeypatch.undo()
    next((tmp_path / ".splits").glob("*.npz")).write_bytes(b"PK\x03\x04 damaged")
    redone = held_out_split(cfg, 0, ds)  # a damaged file is recomputed and replaced
    assert redone.report.cache == "written" and np.array_equal(redone.eval_rows, first.eval_rows)


def test_unwritable_cache_computes_in_memory(tmp_path):
    ds = grouped_dataset(tmp_path)
    (tmp_path / ".splits").write_text("a file where the cache directory would go")
    split = held_out_split(DataConfig(path="x", eval_fraction=0.2), 0, ds)
    assert split.report.cache.startswith("not written") and len(split.eval_rows) > 0


def test_config_validation():
    for bad in ({"dedup_threshold": 1.5}, {"dedup_threshold": -0.1}, {"dedup_ngram": 0}, {"eval_split": "random"}):
        with pytest.raises(ValueError):
            DataConfig(**bad)


# ---------------------------------------------------------------- open_data on prepared datasets

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("splits")
    build_tokenizer(root / "tok")
    rows = synthetic_conversations(160)
    return root, prepare_dataset(root / "tok", rows, root / "train")


def test_open_data_prompt_split_reports_caches_and_lists_eval_prompts(prepared, caplog):
    _, path = prepared
    cfg = DataConfig(path=str(path), eval_fraction=0.1)
    with caplog.at_level("INFO", logger="dflash_train.data.splits"):
        data = open_data(cfg, seed=3, vocab_size=300, tokenizer_identity=None)
    r = data.report  # the toy chats are templated: "say red many times" near-duplicates "say blue many times"
    assert isinstance(r, SplitReport) and r.rule == "prompt" and r.cache == "written" and not r.duplicates_kept
    assert "eval split (prompt)" in caplog.text and len(data.eval) == r.eval_rows_kept > 0
    assert r.eval_rows_kept == r.eval_rows - r.dropped_prompt_duplicates - r.dropped_answer_duplicates < r.eval_rows
    prompts = data.eval_prompts()
    assert len({p.tobytes() for p in prompts}) == len(prompts) == len({prompt_and_answer(data.eval[i])[0].tobytes()
                                                                      for i in range(len(data.eval))})
    assert [p.tobytes() for p in data.eval_prompts(2)] == [p.tobytes() for p in prompts[:2]]
    train_prompts = {prompt_and_answer(data.train[i])[0].tobytes() for i in range(len(data.train))}
    assert not train_prompts & {p.tobytes() for p in prompts}
    again = open_data(cfg, seed=3, vocab_size=300, tokenizer_identity=None)
    assert again.report.cache == "hit" and np.array_equal(again.eval.indices, data.eval.indices)
    # seed 0 draws one prompt whose every answer near-duplicates a training answer: kept, with a warning
    caplog.clear()
    fallback = open_data(cfg, seed=0, vocab_size=300, tokenizer_identity=None)
    assert fallback.report.duplicates_kept and len(fallback.eval) == fallback.report.eval_rows > 0
    assert "WARNING: every eval row" in caplog.text


def test_eval_split_row_is_the_old_random_split(prepared):
    _, path = prepared
    data = open_data(DataConfig(path=str(path), eval_fraction=0.1, eval_split="row"), seed=3, vocab_size=300,
                     tokenizer_identity=None)
    order = np.random.default_rng([3, 7]).permutation(160)
    assert data.report.rule == "row" and data.report.cache == ""
    assert np.array_equal(data.eval.indices, np.sort(order[:16])) and np.array_equal(data.train.indices,
                                                                                     np.sort(order[16:]))
    synthetic = open_data(DataConfig(path="synthetic:50:8", eval_fraction=0.1), seed=3, vocab_size=300,
                          tokenizer_identity=None)
    assert synthetic.report.rule == "row" and len(synthetic.eval) == 5


def test_eval_path_drops_rows_that_repeat_training_rows(prepared):
    root, path = prepared
    train = TokenDataset(path)
    repeated = synthetic_conversations(160)[:3]  # in the training data
    new = [{"messages": [{"role": "user", "content": "tell me about the green moon"},
                         {"role": "assistant", "content": "the green moon is red and blue"}]}]
    eval_path = prepare_dataset(root / "tok", repeated + new, root / "eval")
    data = open_data(DataConfig(path=str(path), eval_path=str(eval_path)), seed=0, vocab_size=300,
                     tokenizer_identity=None)
    assert data.report.rule == "eval_path" and data.train is not None and len(data.train) == len(train)
    assert data.report.dropped_prompt_duplicates == 3 and data.eval.indices.tolist() == [3]
    same = open_data(DataConfig(path=str(path), eval_path=str(path)), seed=0, vocab_size=300, tokenizer_identity=None)
    assert same.report.duplicates_kept and len(same.eval) == len(train)  # nothing held out: kept, with a warning


def test_a_large_dataset_is_split_in_worker_processes_with_the_same_result(prepared, monkeypatch):
    _, path = prepared
    cfg = DataConfig(path=str(path), eval_fraction=0.2)
    one = compute_split(cfg, 3, TokenDataset(path))
    assert one.report.dropped_prompt_duplicates + one.report.dropped_answer_duplicates > 0  # the dedup works
    monkeypatch.setattr(splits, "PARALLEL_MIN_ROWS", 100)  # 160 rows: large enough here
    monkeypatch.setattr(splits, "cores_of_this_process", lambda: 2)
    monkeypatch.setattr(splits, "CACHE_DIR", ".splits-workers")  # not the other tests' cache
    two = held_out_split(cfg, 3, TokenDataset(path))
    assert two.report.workers == 2 and " in 2 processes" in two.report.describe()
    assert np.array_equal(two.eval_rows, one.eval_rows) and np.array_equal(two.train_rows, one.train_rows)
    same = {k: v for k, v in vars(two.report).items() if k not in ("seconds", "workers", "cache")}
    assert same == {k: v for k, v in vars(one.report).items() if k not in ("seconds", "workers", "cache")}
    monkeypatch.setattr(splits, "PARALLEL_MIN_ROWS", 1_000)
    monkeypatch.setattr(splits, "CACHE_DIR", ".splits-small")
    assert held_out_split(cfg, 3, TokenDataset(path)).report.workers == 1  # below the size: in this process
