"""Brute-force references for the DFlash semantics, written from docs/dflash-spec.md in
plain Python loops, independent of the vectorised implementation under test."""

from __future__ import annotations

import math
import random

import torch
from torch.nn.attention.flex_attention import create_mask


def random_packed_layout(rng: random.Random, R: int, S: int, max_docs: int = 4, pad_prob: float = 0.5):
    """Rows of packed documents with restarting positions, random loss masks and tail padding."""
    doc = torch.full((R, S), -1, dtype=torch.long)
    pos = torch.zeros((R, S), dtype=torch.long)
    loss = torch.zeros((R, S), dtype=torch.bool)
    ids = torch.zeros((R, S), dtype=torch.long)
    next_doc = 0
    for r in range(R):
        used = S - (rng.randrange(0, S // 3) if rng.random() < pad_prob else 0)
        cuts = sorted(rng.sample(range(1, used), k=min(max_docs - 1, used - 1))) if used > 1 else []
        bounds = [0] + [c for c in cuts if rng.random() < 0.7] + [used]
        for a, b in zip(bounds[:-1], bounds[1:]):
            for p in range(a, b):
                doc[r, p] = next_doc
                pos[r, p] = p - a
                ids[r, p] = rng.randrange(1, 50)
                # assistant spans: runs of loss tokens interleaved with prompt tokens
                loss[r, p] = rng.random() < 0.6
            next_doc += 1
    return ids, pos, doc, loss


def candidates_ref(loss, doc):
    R, S = doc.shape
    out = []
    for r in range(R):
        row = []
        for p in range(S - 1):
            if doc[r, p] >= 0 and doc[r, p + 1] == doc[r, p] and bool(loss[r, p + 1]):
                row.append(p)
        out.append(row)
    return out


def mask_ref(doc, pos, anchors, valid, B, window=None, causal=False):
    """The spec's mask rule, entry by entry."""
    R, S = doc.shape
    N = anchors.shape[1]
    Q = N * B
    m = torch.zeros((R, Q, S + Q), dtype=torch.bool)
    for r in range(R):
        for j in range(N):
            a = int(anchors[r, j])
            for k in range(B):
                q = j * B + k
                for s in range(S):
                    ok = bool(valid[r, j]) and doc[r, s] == doc[r, a] and s < a
                    if ok and window is not None:
                        ok = (int(pos[r, a]) + k) - int(pos[r, s]) < window
                    m[r, q, s] = ok
                for j2 in range(N):
                    for k2 in range(B):
                        ok = j2 == j and (not causal or k2 <= k)
                        m[r, q, S + j2 * B + k2] = ok
    return m


def labels_ref(ids, doc, loss, anchors, valid, B):
    R, S = doc.shape
    N = anchors.shape[1]
    labels = torch.full((R, N, B), -100, dtype=torch.long)
    lv = torch.zeros((R, N, B), dtype=torch.bool)
    for r in range(R):
        for j in range(N):
            a = int(anchors[r, j])
            if not valid[r, j]:
                continue
            for k in range(1, B):
                p = a + k
                if p < S and doc[r, p] == doc[r, a] and bool(loss[r, p]):
                    labels[r, j, k] = ids[r, p]
                    lv[r, j, k] = True
    return labels, lv


def decay_ref(B, gamma):
    return [math.exp(-(k - 1) / gamma) for k in range(1, B)]


def cap_ref(c, alpha, eps):
    """c: list of probabilities (None = invalid slot). Returns w_k = sum_{m>=k} prod_{i<=m} c_i^alpha."""
    cs = [0.0 if x is None else x ** alpha for x in c]
    prods = []
    acc = 1.0
    for x in cs:
        acc *= x
        prods.append(acc)
    return [max(sum(prods[k:]), eps) for k in range(len(cs))]


def dpace_ref(c, alpha):
    """c: list of probabilities (None = invalid slot). D-PACE: a valid slot's confidence is
    alpha + (1 - alpha) p; w_k = sum over valid m >= k of the product of the valid confidences
    up to m (an invalid slot adds no term and no factor)."""
    weights = []
    for k in range(len(c)):
        total = 0.0
        for m in range(k, len(c)):
            if c[m] is None:
                continue
            prod = 1.0
            for i in range(m + 1):
                if c[i] is not None:
                    prod *= alpha + (1 - alpha) * c[i]
            total += prod
        weights.append(total)
    return weights


def tau_ref(pred, labels, lv):
    """Blocks with any valid label: 1 + leading slots (k = 1, 2, ...) predicted right."""
    R, N, B = labels.shape
    total, blocks = 0, 0
    for r in range(R):
        for j in range(N):
            if not any(bool(lv[r, j, k]) for k in range(1, B)):
                continue
            blocks += 1
            run = 0
            for k in range(1, B):
                if lv[r, j, k] and pred[r, j, k] == labels[r, j, k]:
                    run += 1
                else:
                    break
            total += 1 + run
    return total, blocks


def effective_mask(bm, mask_mod, R, Q, KV):
    """What FlexAttention computes with a BlockMask: full tiles all visible, partial tiles
    through mask_mod, unlisted tiles invisible."""
    tq, tk = bm.BLOCK_SIZE
    grid = create_mask(mask_mod, R, 1, Q, KV, device="cpu")[:, 0]
    out = torch.zeros(R, Q, KV, dtype=torch.bool)
    for r in range(R):
        for qb in range(bm.kv_num_blocks.shape[2]):
            qs = slice(qb * tq, (qb + 1) * tq)
            for i in range(int(bm.kv_num_blocks[r, 0, qb])):
                kb = int(bm.kv_indices[r, 0, qb, i])
                out[r, qs, kb * tk:(kb + 1) * tk] = grid[r, qs, kb * tk:(kb + 1) * tk]
            for i in range(int(bm.full_kv_num_blocks[r, 0, qb])):
                kb = int(bm.full_kv_indices[r, 0, qb, i])
                assert not out[r, qs, kb * tk:(kb + 1) * tk].any(), "tile listed as partial and full"
                out[r, qs, kb * tk:(kb + 1) * tk] = True
    return out
