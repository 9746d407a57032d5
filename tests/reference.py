"""A deliberately naive reference of the eviction formulas in ``shared/spec/algorithms.md``.

Written from the spec, not from the library: plain Python loops over batch rows, KV heads, query
heads and window queries, float64 throughout, nothing vectorised across rows or heads. It is slow
on purpose and only meant for small test inputs.

Conventions: ``K, V`` are ``[B, Hkv, N, D]``, ``Q`` is ``[B, Hq, W, D]``; query head ``h*G + g``
belongs to KV head ``h``. Candidates are slots ``0 .. C-1``; slots ``C .. N-1`` are the recent
buffer. Scores come back as ``[B, Hkv, N]`` float64 with zeros outside the valid candidates.
"""

from __future__ import annotations

import math
from collections import deque

import torch


def _valid(slot_valid, b, h, n):
    """Validity of the slots of row ``b``, head ``h``; ``slot_valid`` is ``[B, N]`` or ``[B, Hkv, N]``."""
    if slot_valid is None:
        return [True] * n
    row = slot_valid[b] if slot_valid.dim() == 2 else slot_valid[b, h]
    return [bool(x) for x in row.tolist()]


def _qvalid(query_valid, b, w):
    return [True] * w if query_valid is None else [bool(x) for x in query_valid[b].tolist()]


def softmax(xs: list[float]) -> list[float]:
    """Softmax of a list; entries equal to -inf get probability 0."""
    finite = [x for x in xs if x != -math.inf]
    if not finite:
        return [0.0] * len(xs)
    m = max(finite)
    ex = [0.0 if x == -math.inf else math.exp(x - m) for x in xs]
    s = sum(ex)
    return [e / s for e in ex]


def pool1d(xs: list[float], kind: str, kernel: int) -> list[float]:
    """Stride 1, zero padding ``kernel // 2`` on both sides; avg divides by ``kernel``."""
    if kind == "none":
        return list(xs)
    pad = kernel // 2
    out = []
    for j in range(len(xs)):
        win = [xs[j + o] if 0 <= j + o < len(xs) else 0.0 for o in range(-pad, pad + 1)]
        out.append(sum(win) / kernel if kind == "avg" else max(win))
    return out


def attention(
    K,
    Q,
    C: int,
    *,
    group_reduce: str = "mean",
    group_reduce_at: str = "after_softmax",
    window_reduce: str = "mean",
    pooling: str = "avg",
    kernel: int = 5,
    slot_valid=None,
    query_valid=None,
) -> torch.Tensor:
    """SnapKV-family attention importance.

    after_softmax (VaSE / SnapKV): per query head softmax over candidates, window mean (or sum),
    pooling, then reduce the G heads of the group. before_softmax (R-KV): reduce the G heads on the
    raw logits, softmax, window reduce, pooling.
    """
    K = K.double()
    Q = Q.double()
    B, Hkv, N, D = K.shape
    Hq, W = Q.shape[1], Q.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        qv = _qvalid(query_valid, b, W)
        n_real_q = sum(qv)
        for h in range(Hkv):
            sv = _valid(slot_valid, b, h, N)
            # logits[g][w][j]
            logits = []
            for g in range(G):
                per_w = []
                for w in range(W):
                    q = Q[b, h * G + g, w]
                    row = []
                    for j in range(C):
                        if sv[j]:
                            row.append(float(torch.dot(q, K[b, h, j])) / math.sqrt(D))
                        else:
                            row.append(-math.inf)
                    per_w.append(row)
                logits.append(per_w)
            if group_reduce_at == "before_softmax":
                red = []
                for w in range(W):
                    row = []
                    for j in range(C):
                        vals = [logits[g][w][j] for g in range(G)]
                        if group_reduce == "max":
                            row.append(max(vals))
                        else:
                            row.append(sum(vals) / G if vals[0] != -math.inf else -math.inf)
                    red.append(row)
                heads = [red]
            else:
                heads = logits
            per_head_scores = []
            for per_w in heads:
                acc = [0.0] * C
                for w in range(W):
                    if not qv[w]:
                        continue
                    p = softmax(per_w[w])
                    for j in range(C):
                        acc[j] += p[j]
                if window_reduce == "mean":
                    acc = [a / max(n_real_q, 1) for a in acc]
                per_head_scores.append(pool1d(acc, pooling, kernel))
            if group_reduce_at == "before_softmax":
                final = per_head_scores[0]
            elif group_reduce == "max":
                final = [max(s[j] for s in per_head_scores) for j in range(C)]
            else:
                final = [sum(s[j] for s in per_head_scores) / G for j in range(C)]
            for j in range(C):
                out[b, h, j] = final[j]
    return out


def redundancy(K, C: int, *, threshold: float | None = 0.5, over: str = "all", slot_valid=None) -> torch.Tensor:
    """R-KV key redundancy.

    ``over="all"``: rows and columns are every cached slot; ``"candidates"``: the first C only.
    Cosine similarity with a zero diagonal; for each row, the most recent column above
    ``threshold`` (column 0 when none: a left-padded row's first valid slot) is zeroed; mean
    over rows; softmax over columns; the candidate columns are returned. Padding slots are
    neither rows nor columns.
    """
    K = K.double()
    B, H, N, _ = K.shape
    M = N if over == "all" else C
    out = torch.zeros(B, H, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            sv = _valid(slot_valid, b, h, N)
            kn = []
            for i in range(M):
                k = K[b, h, i]
                kn.append(k / (math.sqrt(float(torch.dot(k, k))) + 1e-8))
            sim = [[0.0] * M for _ in range(M)]
            for i in range(M):
                for j in range(M):
                    if i != j and sv[i] and sv[j]:
                        sim[i][j] = float(torch.dot(kn[i], kn[j]))
            if threshold is not None:
                for i in range(M):
                    if not sv[i]:
                        continue
                    last = sv.index(True)  # none above: the row's first cached token (j = 0 alone)
                    for j in range(M):
                        if sim[i][j] > threshold:
                            last = j
                    sim[i][last] = 0.0
            rows = [i for i in range(M) if sv[i]]
            mean = []
            for j in range(M):
                if sv[j]:
                    mean.append(sum(sim[i][j] for i in rows) / max(len(rows), 1))
                else:
                    mean.append(-math.inf)
            red = softmax(mean)
            for j in range(C):
                out[b, h, j] = red[j]
    return out


def gaussian_projection(d: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    """``P`` with entries ``N(0, 1) / sqrt(rank)``."""
    return torch.randn(d, rank, generator=generator, dtype=torch.float64) / math.sqrt(rank)


def leverage(
    K, V, C: int, P, *, mode: str = "kv_product", local_window: int | None = None, slot_valid=None
) -> torch.Tensor:
    """Gaussian-projection leverage with an explicit projection.

    ``P`` is ``[D, r]`` (shared by every row) or ``[B, D, r]`` (one per batch row).
    """
    K = K.double()
    V = V.double()
    P = torch.as_tensor(P).double()
    B, H, N, _ = K.shape
    out = torch.zeros(B, H, N, dtype=torch.float64)

    def normalise(xs):
        s = sum(xs)
        return [x / s if s > 0 else 0.0 for x in xs]

    def local(xs):
        if local_window is None:
            return xs
        res = []
        for start in range(0, len(xs), local_window):
            res.extend(normalise(xs[start : start + local_window]))
        return res

    for b in range(B):
        p = P[b] if P.dim() == 3 else P
        for h in range(H):
            sv = _valid(slot_valid, b, h, N)
            k2, v2 = [], []
            for j in range(C):
                if not sv[j]:
                    k2.append(0.0)
                    v2.append(0.0)
                    continue
                k2.append(float((K[b, h, j] @ p).pow(2).sum()))
                v2.append(float((V[b, h, j] @ p).pow(2).sum()))
            k2, v2 = local(k2), local(v2)
            if mode == "kv_product":
                s = [a * c for a, c in zip(k2, v2, strict=True)]
            elif mode == "key":
                s = k2
            elif mode == "value":
                s = v2
            else:
                s = [0.5 * (a + c) for a, c in zip(normalise(k2), normalise(v2), strict=True)]
            s = normalise(s)
            for j in range(C):
                out[b, h, j] = s[j]
    return out


def value_magnitude(V, metric: str = "range") -> torch.Tensor:
    """Range (max - min over d), population variance over d, or L2 norm, per slot."""
    V = V.double()
    B, H, N, D = V.shape
    out = torch.zeros(B, H, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for j in range(N):
                xs = V[b, h, j].tolist()
                if metric == "range":
                    out[b, h, j] = max(xs) - min(xs)
                elif metric == "variance":
                    mu = sum(xs) / D
                    out[b, h, j] = sum((x - mu) ** 2 for x in xs) / D
                else:
                    out[b, h, j] = math.sqrt(sum(x * x for x in xs))
    return out


def key_norm(K, *, low_norm_first: bool = True) -> torch.Tensor:
    """Knorm: ``-||k_j||_2`` per KV head (``||k_j||_2`` when not ``low_norm_first``), summed in float64."""
    K = K.double()
    B, H, N, D = K.shape
    out = torch.zeros(B, H, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for j in range(N):
                norm = math.sqrt(sum(float(K[b, h, j, c]) ** 2 for c in range(D)))
                out[b, h, j] = -norm if low_norm_first else norm
    return out


def current_attention(
    K, Q, *, group_reduce: str = "mean", head_reduce: str = "group", slot_valid=None, query_valid=None
) -> torch.Tensor:
    """Attention of each row's newest valid query over every valid slot (recent ones included).

    Per query head: softmax of ``q . k_j / sqrt(D)`` over the valid slots of its KV head. Then
    ``head_reduce="group"``: mean (or max) over the ``G`` query heads of each KV head;
    ``"layer"`` (TOVA): mean (or max) over all ``Hq`` query heads of the layer, the one result
    given to every KV head. A row without a valid query scores 0.
    """
    K = K.double()
    Q = Q.double()
    B, Hkv, N, D = K.shape
    Hq, W = Q.shape[1], Q.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        qv = _qvalid(query_valid, b, W)
        if not any(qv):
            continue
        w = max(i for i in range(W) if qv[i])
        probs = []  # probs[hq][j]
        for hq in range(Hq):
            h = hq // G
            sv = _valid(slot_valid, b, h, N)
            row = [
                sum(float(Q[b, hq, w, c]) * float(K[b, h, j, c]) for c in range(D)) / math.sqrt(D) if sv[j] else -math.inf
                for j in range(N)
            ]
            probs.append(softmax(row))
        for h in range(Hkv):
            heads = range(Hq) if head_reduce == "layer" else range(h * G, (h + 1) * G)
            for j in range(N):
                vals = [probs[hq][j] for hq in heads]
                out[b, h, j] = max(vals) if group_reduce == "max" else sum(vals) / len(vals)
    return out


def top_reservation(scores_bh, candidates: list[int], protected: set[int], n: int, include_prior: bool) -> set[int]:
    """The ``n`` open candidates with the largest scores (minus protected ones if ``include_prior``)."""
    need = n - (len(protected & set(candidates)) if include_prior else 0)
    open_ = [j for j in candidates if j not in protected]
    open_.sort(key=lambda j: -float(scores_bh[j]))
    return set(open_[: max(0, need)])


def select(
    scores,
    *,
    budget: int,
    recent: int,
    sinks: int = 0,
    reserve_scores=None,
    reserve_n: int = 0,
    include_prior: bool = True,
    slot_valid=None,
    positions=None,
) -> list[list[list[int]]]:
    """Greedy selection for one eviction: protected slots, then the best-scored candidates.

    Protected: the recent buffer (last ``recent`` slots), the slots of the first ``sinks`` real
    tokens, and ``reserve_n`` open candidates with the largest ``reserve_scores``. Returns the
    kept slots, ascending, per ``[b][h]``.
    """
    B, H, N = scores.shape
    C = N - recent
    K = min(N, budget)
    out = []
    for b in range(B):
        row = []
        for h in range(H):
            sv = _valid(slot_valid, b, h, N)
            if positions is None:
                pos, seen = [], 0
                for j in range(N):
                    pos.append(seen if sv[j] else -1)
                    seen += sv[j]
            else:
                pos = (positions[b] if positions.dim() == 2 else positions[b, h]).tolist()
            if N <= budget:
                row.append(list(range(N)))
                continue
            protected = set(range(C, N))
            protected |= {j for j in range(N) if sv[j] and 0 <= pos[j] < sinks}
            cands = [j for j in range(C) if sv[j]]
            if reserve_n:
                protected |= top_reservation(reserve_scores[b, h], cands, protected, reserve_n, include_prior)
            free = [j for j in cands if j not in protected]
            free.sort(key=lambda j: -float(scores[b, h, j]))
            kept = sorted(protected | set(free[: K - len(protected)]))
            row.append(kept)
        out.append(row)
    return out


def policy_scores(cfg: dict, K, V, Q, *, slot_valid=None, query_valid=None, projection=None):
    """Reference scores for a resolved policy dict (``PolicyConfig.to_dict()``) of known stages."""
    C = K.shape[2] - cfg["schedule"]["recent"]
    return _stage_scores(cfg["scorer"], K, V, Q, C, slot_valid, query_valid, projection)


def _stage_scores(spec, K, V, Q, C, slot_valid, query_valid, projection):
    t = spec["type"]
    if t == "attention":
        return attention(
            K, Q, C, group_reduce=spec["group_reduce"], group_reduce_at=spec["group_reduce_at"],
            window_reduce=spec["window_reduce"], pooling=spec["pooling"], kernel=spec["kernel"],
            slot_valid=slot_valid, query_valid=query_valid,
        )
    if t == "redundancy":
        return redundancy(K, C, threshold=spec["threshold"], over=spec["over"], slot_valid=slot_valid)
    if t == "leverage":
        return leverage(K, V, C, projection, mode=spec["mode"], local_window=spec["local_window"],
                        slot_valid=slot_valid)
    if t == "value_magnitude":
        return value_magnitude(V, spec["metric"])
    if t == "current_attention":
        return current_attention(K, Q, group_reduce=spec["group_reduce"], head_reduce=spec["head_reduce"],
                                 slot_valid=slot_valid, query_valid=query_valid)
    if t == "key_norm":
        return key_norm(K, low_norm_first=spec["low_norm_first"])
    if t == "combination":
        total = None
        for term in spec["terms"]:
            s = term["weight"] * _stage_scores(term["scorer"], K, V, Q, C, slot_valid, query_valid, projection)
            total = s if total is None else total + s
        return total
    raise NotImplementedError(t)


def _held_positions(slot_valid, positions, b, h, n):
    """Validity and token position of each slot of row ``b``, head ``h`` (default positions:
    index among the row's valid slots)."""
    sv = _valid(slot_valid, b, h, n)
    if positions is not None:
        return sv, (positions[b] if positions.dim() == 2 else positions[b, h]).tolist()
    pos, seen = [], 0
    for j in range(n):
        pos.append(seen if sv[j] else -1)
        seen += sv[j]
    return sv, pos


def chunk_select(scores, *, budget: int, recent: int, chunk_size: int, sinks: int = 0, slot_valid=None, positions=None):
    """ChunkKV (paper Alg. 1) on top of greedy's protected slots: the recent buffer and sinks are
    kept; the other candidates are taken chunk by chunk (chunk = ``position // chunk_size``),
    chunks by the float64 sum of their candidates' scores (ties: the earlier chunk), inside a
    chunk by score (ties: the lower slot), until ``min(N, budget)`` slots are kept.
    Returns kept slots ascending per ``[b][h]``."""
    B, H, N = scores.shape
    C = N - recent
    out = []
    for b in range(B):
        row = []
        for h in range(H):
            sv, pos = _held_positions(slot_valid, positions, b, h, N)
            if N <= budget:
                row.append(list(range(N)))
                continue
            protected = set(range(C, N)) | {j for j in range(N) if sv[j] and 0 <= pos[j] < sinks}
            chunks: dict[int, list[int]] = {}
            for j in range(C):
                if sv[j]:
                    chunks.setdefault(pos[j] // chunk_size, []).append(j)
            total = {c: sum(float(scores[b, h, j]) for j in js) for c, js in chunks.items()}
            kept = set(protected)
            for c in sorted(chunks, key=lambda c: (-total[c], c)):
                for j in sorted(chunks[c], key=lambda j: (-float(scores[b, h, j]), j)):
                    if len(kept) < budget and j not in kept:
                        kept.add(j)
            row.append(sorted(kept))
        out.append(row)
    return out


def lag(K, V, *, lag_size: int, sink: int, score_v_ratio: float = 1.0, slot_valid=None,
        rank_within_partition: bool = False):
    """LagKV (official ``lag_kv.py``), float64 loops. Per row and head, the held slots after the
    first ``sink`` form partitions of ``lag_size``; partition ``p`` is scored against ``p + 1``:
    per channel ``(x - min) / (max - min)`` over the reference (0 where the reference's range is
    0), the unbiased std over the channels, a softmax over the partition; keys plus
    ``score_v_ratio`` times values. The sinks and the tail (the last full partition and the rest)
    are not scored: they get ``1e9`` (sinks) and ``1e6 + rank`` (tail, newest highest), above
    every partition score. Padding scores 0. With ``rank_within_partition`` a partition's scores
    are then replaced by their ranks in it over ``lag_size`` (0 the lowest; equal scores ranked by
    position), plus ``p / (N // lag_size + 1)`` ranks, so equal ranks favour the newer partition."""
    B, H, N, _ = K.shape

    def states(X, members, ref):
        cols = range(X.shape[-1])
        lo = [min(float(X[j, c]) for j in ref) for c in cols]
        hi = [max(float(X[j, c]) for j in ref) for c in cols]
        spread = []
        for j in members:
            xs = [(float(X[j, c]) - lo[c]) / (hi[c] - lo[c]) if hi[c] != lo[c] else 0.0 for c in cols]
            mu = sum(xs) / len(xs)
            spread.append(math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)))
        return softmax(spread)

    out = torch.zeros(B, H, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            held = [j for j, ok in enumerate(_valid(slot_valid, b, h, N)) if ok]
            full = max(0, (len(held) - sink) // lag_size)
            parts = [held[sink + p * lag_size: sink + (p + 1) * lag_size] for p in range(full)]
            for r, j in enumerate(held):
                out[b, h, j] = 1e9 if r < sink else 1e6 + r
            for p in range(full - 1):
                sk = states(K[b, h].double(), parts[p], parts[p + 1])
                sv = states(V[b, h].double(), parts[p], parts[p + 1])
                raw = [sk[i] + score_v_ratio * sv[i] for i in range(len(parts[p]))]
                if rank_within_partition:
                    order = sorted(range(len(raw)), key=lambda i: (raw[i], i))
                    raw = [(order.index(i) + p / (N // lag_size + 1)) / lag_size for i in range(len(raw))]
                for i, j in enumerate(parts[p]):
                    out[b, h, j] = raw[i]
    return out


def duo_counts(retrieval, *, budget: int, recent: int, sinks: int) -> list[list[int]]:
    """DuoAttention-style counts per (layer, head): streaming heads ``recent + sinks``; the rest of
    ``layers * heads * budget`` shared by the retrieval heads. Written for totals that divide
    evenly (the tests choose such numbers), so no rounding rule is involved."""
    layers, heads = len(retrieval), len(retrieval[0])
    stream = recent + sinks
    n_r = sum(sum(1 for r in row if r) for row in retrieval)
    pool = layers * heads * budget - (layers * heads - n_r) * stream
    assert pool % n_r == 0, "choose numbers that divide evenly"
    return [[pool // n_r if r else stream for r in row] for row in retrieval]


# -- model facts: RoPE and the methods that read it (Expected Attention, TriAttention, CriticalKV) --
def rope_rotation(position: int, d: int, theta: float = 10000.0) -> torch.Tensor:
    """``[D, D]`` float64: the RoPE matrix of ``position`` (rotate-half pairs ``i``, ``i + D/2``),
    built entry by entry."""
    r = torch.zeros(d, d, dtype=torch.float64)
    half = d // 2
    for i in range(half):
        angle = position * theta ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def expected_attention(K, V, Q, query_positions, query_valid=None, slot_valid=None, positions=None, *,
                       n_future: int, n_sink: int, theta: float = 10000.0, use_covariance: bool = True,
                       use_vnorm: bool = True, epsilon: float = 0.0, candidates: int | None = None) -> torch.Tensor:
    """Expected Attention (kvpress's rules, statistics from the window's queries at their own
    positions), one query head and key at a time, in float64."""
    K, V, Q = K.double(), V.double(), Q.double()
    B, Hkv, N, D = K.shape
    Hq, W = Q.shape[1], Q.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        qv = _qvalid(query_valid, b, W)
        used = [w for w in range(W) if qv[w] and int(query_positions[b, w]) >= n_sink]
        newest = max(int(p) for p in query_positions[b].tolist())
        rbar = sum(rope_rotation(newest + 1 + i, D, theta) for i in range(n_future)) / n_future
        for h in range(Hkv):
            sv = _valid(slot_valid, b, h, N)
            pos = list(range(N)) if positions is None else (positions[b] if positions.dim() == 2 else positions[b, h]).tolist()
            inside = [j for j in range(N) if sv[j] and pos[j] >= n_sink and (candidates is None or j < candidates)]
            att = [0.0] * N
            for g in range(G):
                pre = [rope_rotation(int(query_positions[b, w]), D, theta).T @ Q[b, h * G + g, w] for w in used]
                m = len(pre)
                mu = sum(pre) / m if m else torch.zeros(D, dtype=torch.float64)
                cov = sum(torch.outer(p - mu, p - mu) for p in pre) / m if m else torch.zeros(D, D, dtype=torch.float64)
                mu_f, cov_f = rbar @ mu, rbar @ cov @ rbar.T
                z = {}
                for j in inside:
                    k = K[b, h, j]
                    z[j] = float(mu_f @ k) / math.sqrt(D) + (float(k @ cov_f @ k) / (2 * D) if use_covariance else 0.0)
                p = softmax([z[j] for j in inside])
                for j, pj in zip(inside, p, strict=True):
                    att[j] += pj / G
            for j in inside:
                a = att[j]
                out[b, h, j] = (a + epsilon) * float(V[b, h, j].norm()) if use_vnorm else a
    return out


def output_value_norm(V, W, *, norm: int = 1, reduce: str = "mean") -> torch.Tensor:
    """``||v_j W_h||_p`` reduced over the query heads ``h`` of each KV head; ``W`` ``[Hq, D, hidden]``."""
    V, W = V.double(), W.double()
    B, Hkv, N, _ = V.shape
    G = W.shape[0] // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for j in range(N):
                vals = []
                for g in range(G):
                    x = V[b, h, j] @ W[h * G + g]
                    vals.append(float(x.abs().sum()) if norm == 1 else float(x.norm()))
                out[b, h, j] = sum(vals) / G if reduce == "mean" else max(vals)
    return out


def attention_all(K, Q, query_positions, *, kernel: int = 5) -> torch.Tensor:
    """SnapKV's own score: each window query's softmax over every slot it sees (causal; slots at
    positions ``0 .. N-1``), mean over the window, average-pooled (zero padding), group mean; the
    scores of every slot, in float64."""
    K, Q = K.double(), Q.double()
    B, Hkv, N, D = K.shape
    Hq, W = Q.shape[1], Q.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            heads = []
            for g in range(G):
                acc = [0.0] * N
                for w in range(W):
                    t = int(query_positions[b, w])
                    p = softmax([float(Q[b, h * G + g, w] @ K[b, h, j]) / math.sqrt(D) if j <= t else -math.inf
                                 for j in range(N)])
                    for j in range(N):
                        acc[j] += p[j] / W
                heads.append(acc)
            mean = [sum(hd[j] for hd in heads) / G for j in range(N)]
            out[b, h] = torch.tensor(mean, dtype=torch.float64)
    return out


def triattention(K, positions, q_mean, q_abs, *, offsets: list[int], theta: float = 10000.0, normalize: bool = True,
                 reduce: str = "max", candidates: int, trig: bool = True, mlr: bool = True) -> torch.Tensor:
    """TriAttention's score as its authors state it: the key taken back to before RoPE, its
    frequency pairs' moduli and phases against the calibrated mean query, the cosine series at
    ``t0 + delta - p`` summed over pairs, plus the spread term, averaged over ``offsets``; z-score
    per query head over the candidates; ``reduce`` over the group. ``q_mean`` ``[Hq, D/2]``
    complex, ``q_abs`` ``[Hq, D/2]`` (one layer). Plain RoPE (scaling 1)."""
    K = K.double()
    B, Hkv, N, D = K.shape
    half = D // 2
    G = q_mean.shape[0] // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        t0 = max(int(p) for p in positions[b].flatten().tolist()) + 1
        for h in range(Hkv):
            per_head = []
            for g in range(G):
                qm = q_mean[h * G + g].to(torch.complex128)
                qa = q_abs[h * G + g].double()
                scores = []
                for j in range(candidates):
                    p = int(positions[b, h, j]) if positions.dim() == 3 else int(positions[b, j])
                    k = rope_rotation(p, D, theta).T @ K[b, h, j]
                    total = 0.0
                    for delta in offsets:
                        s = 0.0
                        for f in range(half):
                            kf = complex(float(k[f]), float(k[f + half]))
                            omega = theta ** (-2 * f / D)
                            phi = math.atan2((qm[f] * kf.conjugate()).imag, (qm[f] * kf.conjugate()).real)
                            if trig:
                                s += abs(qm[f]) * abs(kf) * math.cos(omega * (t0 + delta - p) + phi)
                            s += (float(qa[f]) - (abs(qm[f]) if mlr else 0.0)) * abs(kf)
                        total += s
                    scores.append(total / len(offsets))
                if normalize:
                    mean = sum(scores) / len(scores)
                    std = max(math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores)), 1e-6)
                    scores = [(x - mean) / std for x in scores]
                per_head.append(scores)
            for j in range(candidates):
                vals = [s[j] for s in per_head]
                out[b, h, j] = max(vals) if reduce == "max" else sum(vals) / G
    return out


# -- stages that keep state: one layer of the cache, token by token --------------------------------
class TokenLoopCache:
    """One layer of an evicting cache whose scorer keeps state, token by token, in float64 Python
    loops: the part the references of H2O, G-KV and LazyEviction share. A subclass gives its
    stage's rules: the state a new token starts with (``fresh``), the per-query update
    (``update``) and the eviction's ranking (``rank``). ``schedule`` is read for ``budget``,
    ``recent``, ``window`` and when a row is due (``due(count, tokens, prompt=...)``).

    Every (row, KV head) holds its tokens in position order, each a dict ``{"pos", "k", "v"}``
    plus its state. A row's real tokens are appended one at a time; each one's query, per query
    head, takes its softmax over the tokens its KV head holds at that step (its own included;
    scaled dot products); its attention output is the probability-weighted sum of the values.
    Then ``update`` gets, per KV head, the probabilities of the ``G`` query heads of its group.
    A row keeps its last ``window`` queries (``queries``: ``(position, [Hq, D])``) and its newest
    token's position (``now``).

    An eviction of a row, per KV head, keeps the ``recent`` newest tokens and ``budget - recent``
    of the others (the candidates) by ``rank``: the reference's own choice (``evict(b)``: the
    highest, ties to the older token), or the cache's, checked to be a top choice
    (``evict(b, kept, tol)``) before the reference continues from it.
    """

    def __init__(self, schedule, batch: int, hkv: int, hq: int):
        self.s, self.hkv, self.g = schedule, hkv, hq // hkv
        self.held: list[list[list[dict]]] = [[[] for _ in range(hkv)] for _ in range(batch)]
        self.queries = [deque(maxlen=schedule.window) for _ in range(batch)]
        self.tokens = [0] * batch
        self.now = [-1] * batch
        self.steps = 0

    # -- the stage's rules -------------------------------------------------------------------------
    def fresh(self, pos: int) -> dict:
        """The state of a token as it arrives at position ``pos``."""
        return {}

    def update(self, b: int, h: int, pos: int, entries: list[dict], probs: list[list[float]]) -> None:
        """The query at ``pos`` of row ``b`` has attended ``entries`` (KV head ``h``'s tokens) with
        ``probs[g][j]`` for each query head ``g`` of the group: update their state in place."""

    def rank(self, b: int, h: int) -> tuple[list[float], list[dict] | None]:
        """At an eviction: the score of each candidate of row ``b``, head ``h`` (higher is kept),
        and optionally, per candidate, the state a kept one stores (``None``: nothing)."""
        raise NotImplementedError

    # -- the loop ----------------------------------------------------------------------------------
    def feed(self, k, v, q, valid) -> list[torch.Tensor | None]:
        """One step: ``k, v [B, Hkv, T, D]``, ``q [B, Hq, T, D]``, ``valid [B, T]``; returns each
        row's attention outputs ``[Hq, T_real, D]`` (its real queries, in order; ``None``: none)."""
        outs = []
        d = k.shape[-1]
        for b in range(k.shape[0]):
            row_out = []
            for t in range(k.shape[2]):
                if not valid[b, t]:
                    continue
                pos = self.tokens[b]
                self.tokens[b] += 1
                self.now[b] = pos
                for h in range(self.hkv):
                    self.held[b][h].append({"pos": pos, "k": k[b, h, t].double(), "v": v[b, h, t].double(),
                                            **self.fresh(pos)})
                self.queries[b].append((pos, q[b, :, t].double()))
                heads = []
                for h in range(self.hkv):
                    entries = self.held[b][h]
                    probs = []
                    for qh in range(h * self.g, (h + 1) * self.g):
                        p = softmax([float(q[b, qh, t].double() @ e["k"]) / math.sqrt(d) for e in entries])
                        probs.append(p)
                        heads.append(sum(pj * e["v"] for e, pj in zip(entries, p, strict=True)))
                    self.update(b, h, pos, entries, probs)
                row_out.append(torch.stack(heads))
            outs.append(torch.stack(row_out, 1) if row_out else None)
        self.steps += 1
        return outs

    def due(self, b: int) -> bool:
        """Whether row ``b`` evicts after the last step (the first step is the prompt)."""
        return bool(self.s.due(len(self.held[b][0]), self.tokens[b], prompt=self.steps == 1))

    def evict(self, b: int, kept: list[set[int]] | None = None, tol: float = 0.0) -> None:
        """Evict row ``b``: with ``kept=None`` the reference chooses; else ``kept`` (per head, the
        positions the cache kept) must be the recent tokens and ``budget - recent`` candidates
        none of which scores below a dropped one by more than ``tol`` (equal scores may go either
        way), and the reference continues from it."""
        take = self.s.budget - self.s.recent
        for h in range(self.hkv):
            entries = self.held[b][h]
            cut = len(entries) - self.s.recent
            old, recent = entries[:cut], entries[cut:]
            scores, stored = self.rank(b, h)
            if kept is None:
                chosen = sorted(sorted(range(cut), key=lambda j: -scores[j])[:take])
            else:
                assert {e["pos"] for e in recent} <= kept[h], (b, h)  # the recent tokens are always kept
                chosen = [j for j in range(cut) if old[j]["pos"] in kept[h]]
                dropped = [j for j in range(cut) if old[j]["pos"] not in kept[h]]
                assert len(chosen) == take == len(kept[h]) - len(recent), (b, h, sorted(kept[h]))
                if dropped:
                    worst_kept = min(scores[j] for j in chosen)
                    best_dropped = max(scores[j] for j in dropped)
                    assert worst_kept >= best_dropped - tol, (b, h, worst_kept, best_dropped)
            if stored is not None:
                for j in chosen:
                    old[j].update(stored[j])
            self.held[b][h] = [old[j] for j in chosen] + recent

    def step(self, k, v, q, valid) -> list[torch.Tensor | None]:
        """``feed``, then every due row evicts by the reference's own choice."""
        outs = self.feed(k, v, q, valid)
        for b in range(k.shape[0]):
            if self.due(b):
                self.evict(b)
        return outs

    def candidates(self, b: int, h: int) -> list[dict]:
        """The tokens an eviction of row ``b``, head ``h`` ranks: all but the ``recent`` newest."""
        entries = self.held[b][h]
        return entries[: len(entries) - self.s.recent]

    def positions(self, b: int, h: int) -> list[int]:
        return [e["pos"] for e in self.held[b][h]]


def threshold_counts(scores, protected, valid, *, threshold: float, floor: int, cap: int | None, budget: int):
    """The threshold rule, per row and head, in float64 loops: which slots are kept.

    ``scores [B, Hkv, N]``, ``protected`` and ``valid`` bool of the same shape. Each head keeps
    its valid protected slots, then its valid unprotected slots in descending score order (ties:
    lower slot first): every one scoring at least ``threshold``, but at least ``floor`` and at
    most ``cap`` of them (``cap`` None: the budget less the protected slots), never past the
    budget. Returns ``[B, Hkv, N]`` bool."""
    b_n, h_n, n = scores.shape
    keep = torch.zeros(b_n, h_n, n, dtype=torch.bool)
    for b in range(b_n):
        for h in range(h_n):
            prot = [j for j in range(n) if bool(valid[b, h, j]) and bool(protected[b, h, j])]
            cands = [j for j in range(n) if bool(valid[b, h, j]) and not bool(protected[b, h, j])]
            cands.sort(key=lambda j: (-float(scores[b, h, j]), j))
            passing = sum(1 for j in cands if float(scores[b, h, j]) >= threshold)
            room = max(0, budget - len(prot))
            most = room if cap is None else min(cap, room)
            m = min(max(passing, floor), most, len(cands))
            for j in prot + cands[:m]:
                keep[b, h, j] = True
    return keep


# -- merges (spec sections 14-16): the new value of every kept slot, as float64 loops --------------
# Each takes ``V [B, Hkv, N, Dv]``, ``keep [B, Hkv, N]`` bool (the kept set) and ``slot_valid`` (a
# valid slot that is not kept is evicted) and returns ``[B, Hkv, N, Dv]`` float64 (non-kept slots:
# their input values), plus what the rule keeps as state.


def _cosine(a: list[float], b: list[float]) -> float:
    na = max(math.sqrt(sum(x * x for x in a)), 1e-6)
    nb = max(math.sqrt(sum(x * x for x in b)), 1e-6)
    return sum((x / na) * (y / nb) for x, y in zip(a, b, strict=True))


def _norm(a: list[float]) -> float:
    return math.sqrt(sum(x * x for x in a))


def _most_similar(K, b, h, e, kept):
    """The kept slot whose key is most cosine-similar to slot ``e``'s (the lowest of equal ones)."""
    best, target = -math.inf, None
    for t in kept:
        s = _cosine(K[b, h, e].tolist(), K[b, h, t].tolist())
        if s > best:
            best, target = s, t
    return best, target


def similar_merge(K, V, keep, slot_valid, *, similarity_threshold=0.0, merge_fraction=1.0):
    """Spec 15 (kvpress MergingPress): each evicted token folds into its most similar kept token."""
    B, H, N, _ = V.shape
    out = V.double().clone()
    for b in range(B):
        for h in range(H):
            kept = [j for j in range(N) if bool(keep[b, h, j])]
            evicted = [j for j in range(N) if bool(slot_valid[b, h, j]) and not bool(keep[b, h, j])]
            found = {e: _most_similar(K, b, h, e, kept) for e in evicted}
            allowed = set(evicted)
            if merge_fraction < 1.0 and evicted:  # the (1 - fraction) quantile, threshold failures at -inf
                gated = sorted(found[e][0] if found[e][0] >= similarity_threshold else -math.inf for e in evicted)
                rank = (1.0 - merge_fraction) * (len(gated) - 1)
                lo, hi = math.floor(rank), math.ceil(rank)
                a, c, w = gated[lo], gated[hi], rank - lo
                cut = a + w * (c - a) if w < 0.5 else c - (c - a) * (1 - w)  # torch.lerp
                allowed = {e for e in evicted if found[e][0] >= cut}
            num = {t: [0.0] * V.shape[-1] for t in kept}
            den = dict.fromkeys(kept, 0.0)
            hit = set()
            for e in evicted:
                s, t = found[e]
                if e not in allowed or s < similarity_threshold:
                    continue
                ve, vt = V[b, h, e].double().tolist(), V[b, h, t].double().tolist()
                w = max(s, 0.0) * _norm(ve) / (_norm(ve) + _norm(vt) + 1e-6)
                num[t] = [a + w * x for a, x in zip(num[t], ve, strict=True)]
                den[t] += w
                hit.add(t)
            for t in hit:
                vt = V[b, h, t].double().tolist()
                out[b, h, t] = torch.tensor([(x + a) / (1.0 + den[t]) for x, a in zip(vt, num[t], strict=True)],
                                            dtype=torch.float64)
    return out


def _cam_receipts(V, keep, slot_valid, positions, attention, draws, b, h, *, merge_budget, weight, window_of=None):
    """CaM's walk over row ``b``, head ``h``, float64: the valid slots by position; each evicted
    token ``e`` has a window, the ``merge_budget`` kept slots after it (those ``window_of(t)``
    allows, if given), and merges iff ``draws < p``, ``p = clamp(A_e / mean A over the window, 0,
    1)`` (NaN 0, inf 1); then each window slot receives ``weight(A_e, |window|) * v_e``. Returns
    ``({slot: [total weight, weighted sum of values]}, {e: p})``."""
    N = V.shape[2]
    order = [j for _, j in sorted((int(positions[b, h, j]), j) for j in range(N) if bool(slot_valid[b, h, j]))]
    got, prob = {}, {}
    for i, e in enumerate(order):
        if bool(keep[b, h, e]):
            continue
        window = [t for t in order[i + 1:] if bool(keep[b, h, t]) and (window_of is None or window_of(t))]
        window = window[:merge_budget]
        if not window:
            continue
        mean = sum(float(attention[b, h, t]) for t in window) / len(window)
        a = float(attention[b, h, e])
        prob[e] = p = (0.0 if a == 0 else 1.0) if mean == 0 else min(max(a / mean, 0.0), 1.0)
        if not float(draws[b, h, e]) < p:
            continue
        w = weight(a, len(window))
        for t in window:
            acc = got.setdefault(t, [0.0, torch.zeros(V.shape[-1], dtype=torch.float64)])
            acc[0] += w
            acc[1] = acc[1] + w * V[b, h, e].double()
    return got, prob


def cam_merge(V, keep, slot_valid, positions, attention, draws, *, merge_budget):
    """Spec 14 (CaM): each evicted token whose draw says so adds ``v / |window|`` to each of the
    ``merge_budget`` kept slots after it (by position). ``draws [B, Hkv, N]`` float: the token
    merges iff ``draws < p``, ``p = clamp(A_i / mean A over the window, 0, 1)`` (NaN 0, inf 1).
    Returns ``(values, p)``."""
    B, H, N, _ = V.shape
    out = V.double().clone()
    prob = torch.zeros(B, H, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            got, ps = _cam_receipts(V, keep, slot_valid, positions, attention, draws, b, h,
                                    merge_budget=merge_budget, weight=lambda a, size: 1.0 / size)
            for e, p in ps.items():
                prob[b, h, e] = p
            for t, (_, added) in got.items():
                out[b, h, t] = V[b, h, t].double() + added
    return out, prob


def d2o_merge(K, V, keep, slot_valid, weight, threshold, evictions, *, ema):
    """Spec 16 (D2O, as kvpolicy reads it): the EMA threshold of the mean nearest similarity, and a
    merge into the most similar kept token weighted ``exp(s) m_e`` against the target's ``e m_t``
    (``weight``: tokens each slot stands for). Returns ``(values, weight, threshold, evictions)``."""
    B, H, N, _ = V.shape
    out, weight = V.double().clone(), weight.double().clone()
    threshold, evictions = threshold.double().clone(), evictions.clone()
    for b in range(B):
        for h in range(H):
            kept = [j for j in range(N) if bool(keep[b, h, j])]
            evicted = [j for j in range(N) if bool(slot_valid[b, h, j]) and not bool(keep[b, h, j])]
            if not evicted:
                continue
            found = {e: _most_similar(K, b, h, e, kept) for e in evicted}
            s_bar = sum(found[e][0] for e in evicted) / len(evicted)
            tau = s_bar if int(evictions[b, h]) == 0 else ema * float(threshold[b, h]) + (1 - ema) * s_bar
            threshold[b, h], evictions[b, h] = tau, int(evictions[b, h]) + 1
            groups: dict[int, list[int]] = {}
            for e in evicted:
                if found[e][0] >= tau:
                    groups.setdefault(found[e][1], []).append(e)
            for t, merged in groups.items():
                total = math.e * float(weight[b, h, t])
                acc = [math.e * float(weight[b, h, t]) * x for x in V[b, h, t].double().tolist()]
                for e in merged:
                    w = math.exp(found[e][0]) * float(weight[b, h, e])
                    total += w
                    acc = [a + w * x for a, x in zip(acc, V[b, h, e].double().tolist(), strict=True)]
                out[b, h, t] = torch.tensor([a / total for a in acc], dtype=torch.float64)
                weight[b, h, t] = total / math.e
    return out, weight, threshold, evictions


def cam_bounded_merge(V, keep, slot_valid, positions, attention, mass, draws, *, merge_budget):
    """``cam``'s bounded rule (``mass: bounded``), float64 loops: each evicted token whose draw is
    under ``p`` (as ``cam_merge``) hands each of the ``merge_budget`` kept slots after it (by
    position) the weight ``1 / |window|``; a kept slot becomes ``(mass_t v_t + sum w v_i) /
    (mass_t + sum w)`` and its mass ``mass_t + sum w``. Returns ``(values, mass)``."""
    B, H, N, _ = V.shape
    out, new_mass = V.double().clone(), mass.double().clone()
    for b in range(B):
        for h in range(H):
            got, _ = _cam_receipts(V, keep, slot_valid, positions, attention, draws, b, h,
                                   merge_budget=merge_budget, weight=lambda a, size: 1.0 / size)
            for t, (w, s) in got.items():
                m = float(mass[b, h, t])
                out[b, h, t] = (m * V[b, h, t].double() + s) / (m + w)
                new_mass[b, h, t] = m + w
    return out, new_mass


def cam_attention_merge(V, keep, slot_valid, positions, attention, absorbed, draws, *, merge_budget,
                        num_candidates, max_absorbed):
    """``cam``'s attention rule (``mass: attention``), float64 loops, written from its statement:
    the window of an evicted token is the ``merge_budget`` kept slots after it (by position) among
    slots ``0 .. num_candidates - 1`` (never the recent buffer); it merges iff ``draws < p``, ``p =
    clamp(A_i / mean A over that window, 0, 1)`` (NaN 0, inf 1), and then gives each window slot
    the weight ``A_i / |window|``. A kept slot ``t`` takes at most ``max_absorbed * A_t - M_t`` of
    what it receives (its shares scaled down alike), and becomes ``((A_t + M_t) v_t + sum w v_i)
    / (A_t + M_t + sum w)``, ``M_t`` (``absorbed``) growing by ``sum w``. Returns ``(values,
    absorbed)``."""
    B, H, N, _ = V.shape
    out, new_absorbed = V.double().clone(), absorbed.double().clone()
    for b in range(B):
        for h in range(H):
            got, _ = _cam_receipts(V, keep, slot_valid, positions, attention, draws, b, h, merge_budget=merge_budget,
                                   weight=lambda a, size: a / size, window_of=lambda t: t < num_candidates)
            for t, (w, s) in got.items():
                own, m = float(attention[b, h, t]), float(absorbed[b, h, t])
                room = max(max_absorbed * own - m, 0.0)
                scale = min(1.0, room / w) if w > 0 else 0.0
                w, s = w * scale, s * scale
                if w <= 0:
                    continue
                out[b, h, t] = ((own + m) * V[b, h, t].double() + s) / (own + m + w)
                new_absorbed[b, h, t] = m + w
    return out, new_absorbed
