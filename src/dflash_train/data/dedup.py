"""Near-duplicate detection on token sequences: shingles, exact Jaccard, MinHash + LSH.

A sequence's shingles are the hashes (`SHINGLE_BITS` bits) of its token n-grams (a sequence
shorter than n has one shingle: itself; an empty one has none). Two sequences are
near-duplicates when the Jaccard similarity |A & B| / |A | B| of their shingle sets is >= a
threshold (exact up to hash collisions: ~1e-12 per pair of distinct n-grams).

`near_duplicate_of(queries, corpus)` says which queries have such a corpus item. Comparing
every pair is too slow for a 1M-row corpus, so candidates come from MinHash + LSH:
`NUM_PERM` seeded hash functions h_k(x) = a_k * x + b_k (mod 2^64) give each set a
signature (the min of each h_k over the set; two sets agree on one component with
probability ~J), cut into `bands` bands of `rows` components; a pair is a candidate when
one whole band agrees, with probability 1 - (1 - J^rows)^bands. Every candidate is then
checked with the exact Jaccard, so a reported pair is never below the threshold (no false
positives); a pair at or above it is missed with probability at most
(1 - threshold^rows)^bands (`miss_probability`). `lsh_shape` picks `rows` per threshold:
for the default 0.5 it is 42 bands of 3, missing a pair at J = 0.5 with probability 0.0037,
at J = 0.6 with 4e-5, at J >= 0.7 with < 3e-8.

The corpus is streamed in chunks of `CHUNK_TOKENS` (only the queries are held in memory) and
each corpus item is read once. Speed, measured on the development VM (2 vCPUs shared with
other work): 100K random corpus rows of 1,000 tokens (1e8 shingles) against 2,000 queries
(200 planted near-duplicates, all found), threshold 0.5: 18.1 s with 5-grams, 18.7 s with
3-grams, i.e. ~5.5M corpus tokens/s, ~70% of it MinHash (128 multiply-add passes over every
shingle). It is linear in corpus tokens: 1M rows x 1K tokens take about 3 minutes, plus the
exact checks of LSH candidates (few unless many pairs sit near the threshold).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_train.utils.parallel import ordered_map

NUM_PERM = 128  # MinHash hash functions; LSH uses bands * rows <= NUM_PERM of them
MIN_RECALL = 0.995  # lsh_shape: find a pair exactly at the threshold with at least this probability
CHUNK_TOKENS = 1 << 17  # corpus tokens shingled and hashed at a time (a few MiB of temporaries)
_BASE = np.uint64(0x100000001B3)  # odd multiplier of the polynomial n-gram hash
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.zeros(0, np.uint64)
SHINGLE_BITS = 40  # shingle hash width (a collision per pair of shingles: 1e-12); the other 24 bits
_SHINGLE_MASK = np.uint64((1 << SHINGLE_BITS) - 1)  # hold the sequence number while sorting


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (a bijection): spreads structured values over 64 bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_sets(seqs: Sequence[np.ndarray], ngram: int, ignore: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The shingle sets of `seqs`, as CSR: values uint64 [S] (`SHINGLE_BITS`-bit hashes, sorted
    and unique within each set), offsets int64 [len(seqs) + 1]. Shingles in `ignore` (sorted)
    are left out, unless that would leave a non-empty sequence with none (then all are kept)."""
    if len(seqs) >= 1 << (64 - SHINGLE_BITS):
        raise ValueError(f"at most {1 << (64 - SHINGLE_BITS)} sequences per call")
    lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    ends = np.cumsum(lengths)
    tokens = np.concatenate([np.asarray(s) for s in seqs]).astype(np.uint64) if len(seqs) else _EMPTY
    with np.errstate(over="ignore"):
        # polynomial hash mod 2^64 of every window (Horner over the n positions, vectorised over
        # windows), then keep the windows that lie inside one sequence
        windows = max(len(tokens) - ngram + 1, 0)
        poly = tokens[:windows].copy()
        for j in range(1, ngram):
            poly *= _BASE
            poly += tokens[j:j + windows]
        owner = np.repeat(np.arange(len(seqs), dtype=np.uint64), lengths)[:windows]  # sequence of the first token
        inside = np.arange(windows) + ngram <= ends[owner.astype(np.int64)]
        poly, owner = poly[inside] + np.uint64(ngram) * _GOLDEN, owner[inside]
        short = np.flatnonzero((lengths > 0) & (lengths < ngram))  # one shingle each: the whole sequence
        if len(short):
            whole = [np.asarray(seqs[i]).astype(np.uint64) for i in short]
            whole_poly = [(w * _BASE ** np.arange(len(w) - 1, -1, -1, dtype=np.uint64)).sum(dtype=np.uint64)
                          for w in whole]
            poly = np.concatenate([poly, np.array(whole_poly, np.uint64) + lengths[short].astype(np.uint64) * _GOLDEN])
            owner = np.concatenate([owner, short.astype(np.uint64)])
    # the length tag above keeps short-sequence shingles apart from n-grams; one sort of
    # (sequence, hash) keys groups each set and orders it (cheaper than a two-key lexsort)
    keys = np.sort((owner << np.uint64(SHINGLE_BITS)) | (mix64(poly) >> np.uint64(64 - SHINGLE_BITS)))
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if len(keys) else keys
    owner, values = (keys >> np.uint64(SHINGLE_BITS)).astype(np.int64), keys & _SHINGLE_MASK
    if ignore is not None and len(ignore) and len(values):
        at = np.minimum(np.searchsorted(ignore, values), len(ignore) - 1)
        keep = ignore[at] != values
        left = np.bincount(owner[keep], minlength=len(seqs))
        keep |= (left == 0)[owner]  # all boilerplate: compare the sequence on everything it has
        values, owner = values[keep], owner[keep]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(seqs)))]).astype(np.int64)
    return values, offsets


def shingles(ids: np.ndarray, ngram: int) -> np.ndarray:
    """uint64 [S]: the sorted shingle set of one sequence."""
    return shingle_sets([ids], ngram)[0]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique uint64 sets (0 when either is empty)."""
    if not len(a) or not len(b):
        return 0.0
    at = np.minimum(np.searchsorted(b, a), len(b) - 1)
    both = int(np.count_nonzero(b[at] == a))
    return both / (len(a) + len(b) - both)


def lsh_shape(threshold: float) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest chance candidates) that still find a
    pair at `threshold` with probability >= MIN_RECALL."""
    for rows in range(8, 1, -1):
        if 1.0 - miss_probability(threshold, NUM_PERM // rows, rows) >= MIN_RECALL:
            return NUM_PERM // rows, rows
    return NUM_PERM, 1


def miss_probability(jaccard_value: float, bands: int, rows: int) -> float:
    """Probability that LSH does not propose a pair of this Jaccard similarity."""
    return (1.0 - jaccard_value ** rows) ** bands


def _permutations(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 0x5EED])
    a = rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd multipliers
    return a, rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)


def minhash(values: np.ndarray, offsets: np.ndarray, seed: int) -> np.ndarray:
    """uint64 [R, NUM_PERM] MinHash signatures of CSR sets (from `shingle_sets`). Empty sets
    get all-ones rows; callers leave them out (an empty set matches nothing)."""
    a, b = _permutations(seed)
    sig = np.full((len(offsets) - 1, NUM_PERM), np.iinfo(np.uint64).max, np.uint64)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    if not len(nonempty):
        return sig
    starts, hashed = offsets[nonempty], np.empty(len(values), np.uint64)
    with np.errstate(over="ignore"):
        for k in range(NUM_PERM):  # each pass is vectorised over all shingles of all sets
            np.multiply(values, a[k], out=hashed)
            hashed += b[k]
            sig[nonempty, k] = np.minimum.reduceat(hashed, starts)
    return sig


def _band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [R, bands]: one hash per band of each signature (bands are told apart by index)."""
    weights = mix64(np.arange(1, rows + 1, dtype=np.uint64))
    with np.errstate(over="ignore"):
        parts = sig[:, :bands * rows].reshape(len(sig), bands, rows)
        mixed = (parts * weights).sum(axis=2, dtype=np.uint64) + np.arange(bands, dtype=np.uint64) * _GOLDEN
    return mix64(mixed)


def common_shingles(seqs: Sequence[np.ndarray], ngram: int, *, min_fraction: float, min_count: int,
                    sample: int = 20_000, seed: int = 0) -> np.ndarray:
    """uint64 [K] sorted: shingles found in more than `min_fraction` (and at least `min_count`)
    of a seeded sample of `sample` items of `seqs` (boilerplate: a chat template, a system prompt)."""
    picked = np.arange(len(seqs))
    if len(seqs) > sample:
        picked = np.sort(np.random.default_rng([seed, 0xB01]).choice(len(seqs), sample, replace=False))
    values, _ = shingle_sets([seqs[int(i)] for i in picked], ngram)
    unique, counts = np.unique(values, return_counts=True)  # sets are unique per item: counts = items
    return unique[counts >= max(min_count, min_fraction * len(picked))]


def near_duplicate_of(queries: Sequence[np.ndarray], corpus: Sequence[np.ndarray], *, threshold: float,
                      ngram: int, seed: int, ignore: np.ndarray | None = None, workers: int = 1) -> np.ndarray:
    """bool [len(queries)]: does query i have a corpus item with Jaccard >= `threshold` over
    `ngram`-gram shingles (`ignore`d shingles left out, see `shingle_sets`)? Exact on every
    reported pair; a pair is missed with probability <= `miss_probability(threshold, *lsh_shape(threshold))`.
    `corpus` is any sequence (e.g. lazy views of a dataset): it is read once, in order. With
    `workers` > 1 it is read in that many contiguous slices (`corpus[a:b]`, which must pickle
    cheaply) by fresh worker processes (`ordered_map`), and a query is found when any slice finds it: the same
    answer, since every candidate pair is checked exactly."""
    if workers > 1 and len(corpus) >= 2 * workers:
        cuts = np.linspace(0, len(corpus), workers + 1).astype(int).tolist()
        slices = [(queries, corpus[a:b], threshold, ngram, seed, ignore) for a, b in zip(cuts[:-1], cuts[1:])]
        return np.logical_or.reduce(ordered_map(_near_duplicate_in_slice, slices, workers, per_worker=1,
                                                fresh_processes=True))
    found = np.zeros(len(queries), bool)
    q_values, q_offsets = shingle_sets(queries, ngram, ignore)
    q_live = np.flatnonzero(np.diff(q_offsets) > 0)
    if not len(q_live) or not len(corpus):
        return found
    bands, rows = lsh_shape(threshold)
    q_keys = _band_keys(minhash(q_values, q_offsets, seed)[q_live], bands, rows).ravel()  # [Q * bands]
    by_key = np.argsort(q_keys, kind="stable")
    sorted_keys, key_query = q_keys[by_key], q_live[by_key // bands]
    next_item = 0
    while next_item < len(corpus):
        chunk, tokens = [], 0
        while next_item < len(corpus) and tokens < CHUNK_TOKENS:
            chunk.append(corpus[next_item])
            tokens += len(chunk[-1])
            next_item += 1
        c_values, c_offsets = shingle_sets(chunk, ngram, ignore)
        c_live = np.flatnonzero(np.diff(c_offsets) > 0)
        c_keys = _band_keys(minhash(c_values, c_offsets, seed)[c_live], bands, rows).ravel()
        lo, hi = np.searchsorted(sorted_keys, c_keys, "left"), np.searchsorted(sorted_keys, c_keys, "right")
        hits = np.flatnonzero(hi > lo)
        n_hits = hi[hits] - lo[hits]
        # every (query, corpus item) pair sharing a band, each pair once
        pair_query = key_query[np.repeat(lo[hits], n_hits) + (np.arange(n_hits.sum()) - np.repeat(
            np.cumsum(n_hits) - n_hits, n_hits))]
        pair_item = c_live[np.repeat(hits // bands, n_hits)]
        pairs = np.unique(pair_query.astype(np.int64) * len(chunk) + pair_item)
        for q, c in zip((pairs // len(chunk)).tolist(), (pairs % len(chunk)).tolist()):
            if not found[q] and jaccard(q_values[q_offsets[q]:q_offsets[q + 1]],
                                        c_values[c_offsets[c]:c_offsets[c + 1]]) >= threshold:
                found[q] = True
    return found


def _near_duplicate_in_slice(task: tuple) -> np.ndarray:
    """One worker's part of `near_duplicate_of`: (queries, corpus slice, threshold, ngram, seed, ignore)."""
    queries, corpus, threshold, ngram, seed, ignore = task
    return near_duplicate_of(queries, corpus, threshold=threshold, ngram=ngram, seed=seed, ignore=ignore)
