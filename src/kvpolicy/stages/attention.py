"""Attention importance over a window of recent queries (SnapKV family)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from .base import EvictionInput, Scorer


class AttentionScorer(Scorer):
    """How much the last ``W`` queries attend to each candidate slot.

    ``logits = Q K_cand^T / sqrt(D)`` over candidate keys only (``softmax_over: all``: over every
    key the query sees, causally, then read on the candidates), softmax in float32,
    reduced over the window (``window_reduce``) and over the ``G`` query heads of a KV head
    (``group_reduce``, either on the probabilities after softmax or on the raw logits before it),
    then smoothed along the token axis (``pooling`` with ``kernel``, stride 1, zero padding).

    VaSE / SnapKV decode: ``group_reduce=mean, group_reduce_at=after_softmax, window_reduce=mean,
    pooling=avg, kernel=5``. Official R-KV: ``group_reduce=max, group_reduce_at=before_softmax,
    pooling=max, kernel=7``.
    """

    type_name: ClassVar[str] = "attention"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True

    pooling: Literal["none", "avg", "max"] = "avg"
    kernel: int = Field(
        5,
        ge=1,
        le=1023,
        description="Pooling kernel (odd), stride 1, padding kernel // 2; at most 1023 (wider pooling "
        "flattens the scores over the whole cache, and keeps the padded tensors small).",
    )
    group_reduce: Literal["mean", "max"] = "mean"
    group_reduce_at: Literal["after_softmax", "before_softmax"] = "after_softmax"
    window_reduce: Literal["mean", "sum"] = "mean"
    softmax_over: Literal["candidates", "all"] = Field(
        "candidates",
        description="What each window query's softmax runs over: the candidate slots only (VaSE's and "
        "R-KV's decode code: kvpolicy's snapkv), or every slot it can see, the window's own included, "
        "causally (SnapKV's own code and kvpress: snapkv-paper).",
    )
    tile_elements: int = Field(
        1 << 20,
        ge=1,
        le=1 << 26,
        description="Logits computed per tile (performance only; results do not depend on it); at most "
        "2**26, 256 MiB of float32 logits, since a tile buffer of about this size is allocated whatever "
        "the input size.",
    )

    @model_validator(mode="after")
    def _odd_kernel(self) -> AttentionScorer:
        if self.pooling != "none":
            odd_kernel(self.kernel)
        return self

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, _ = inp.keys.shape
        c = inp.num_candidates
        weights = inp.query_valid.float()  # [B, W]; window entries without a query weigh nothing
        if self.window_reduce == "mean":
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
        scores = window_attention(
            inp, weights, softmax_over=self.softmax_over, group_reduce=self.group_reduce,
            group_reduce_at=self.group_reduce_at, tile_elements=self.tile_elements,
        )[..., :c]
        if self.pooling != "none":
            scores = _pool(scores, self.pooling, self.kernel)
        if self.group_reduce_at == "before_softmax":
            scores = scores.squeeze(2)
        else:
            scores = scores.amax(2) if self.group_reduce == "max" else scores.mean(2)
        if c == n:
            return scores
        out = scores.new_zeros(b, hkv, n)
        out[..., :c] = scores
        return out


def window_attention(
    inp: EvictionInput,
    weights: torch.Tensor,
    *,
    softmax_over: Literal["candidates", "all"] = "candidates",
    group_reduce: Literal["mean", "max", "sum"] = "mean",
    group_reduce_at: Literal["after_softmax", "before_softmax"] = "after_softmax",
    tile_elements: int = 1 << 20,
) -> torch.Tensor:
    """The attention the window's queries pay each slot, summed over the window with ``weights``
    ``[B, W]``: ``[B, Hkv, G, S]`` float32 per query head of each KV head (``[B, Hkv, 1, S]`` when
    the group is reduced before the softmax).

    ``softmax_over="candidates"``: each query's softmax runs over the valid candidate slots only,
    ``S = C`` columns (VaSE's and R-KV's decode code). ``"all"``: over every valid slot the query
    can see (position at most its own, ``inp.query_positions``: causal), ``S = N`` columns, as a
    query attended them at its own step (SnapKV's own code, H2O).
    """
    b, hkv, n, d = inp.keys.shape
    c = inp.num_candidates if softmax_over == "candidates" else n
    g, w = inp.group_size, inp.queries.shape[2]
    bh = b * hkv
    # Rows of the flattened [B * Hkv] axis; grouped queries share their KV head's keys.
    # The 1/sqrt(D) scale is folded into the (small) queries, not applied to the logits.
    # float16/bfloat16 inputs are multiplied in float32: a float16 Q K^T overflows as soon as
    # |q . k| / sqrt(D) > 65504 (entries of magnitude ~300 at D = 128). float32 and float64
    # inputs are multiplied as they are.
    low_precision = (torch.float16, torch.bfloat16)
    queries = inp.queries.float() if inp.queries.dtype in low_precision else inp.queries
    q = (queries * (1.0 / math.sqrt(d))).reshape(bh, g, w, d)
    keys = inp.keys[:, :, :c].flatten(0, 1)  # [BH, C, D], a view
    upcast_keys = keys.dtype in low_precision
    valid = inp.slot_valid[..., :c].flatten(0, 1)  # [BH, C]
    visible: torch.Tensor | None = None  # [BH, W, C]: what each query may see (causal), or None: all
    no_slot: torch.Tensor | None  # [BH, W] or [BH, 1]: queries (rows) with no slot to attend
    if softmax_over == "all":
        qpos = inp.query_positions
        slot_pos = inp.positions.flatten(0, 1)  # [BH, N]
        qpos = qpos.to(slot_pos.device).repeat_interleave(hkv, dim=0)  # [BH, W]
        visible = valid[:, None, :] & (slot_pos[:, None, :] <= qpos[:, :, None])
        masked = True
        # [BH, W]: a query that sees no slot (padding) has no mass; from each row's first valid
        # position, not a pass over ``visible``.
        first = torch.where(valid, slot_pos, torch.iinfo(slot_pos.dtype).max).amin(-1)  # [BH]
        no_slot = ~valid.any(-1)[:, None] | (first[:, None] > qpos)
    else:
        masked = not bool(valid.all())
        no_slot = ~valid.any(-1)[:, None] if masked else None  # rows of padding only (no attention mass)
    weights = weights.to(q.device).repeat_interleave(hkv, dim=0)  # [BH, W]
    reduce_first = group_reduce_at == "before_softmax"
    g_out = 1 if reduce_first else g
    scores = torch.empty(bh, g_out, c, dtype=torch.float32, device=inp.keys.device)
    # Tiles of (KV head, query head) blocks: the full [BH, G*W, C] probability tensor is never
    # materialised, and one reused buffer takes every tile's logits and (in place) softmax,
    # which is what makes this faster than writing out the bare Q K^T product.
    g_tile = g if reduce_first else max(1, min(g, tile_elements // max(1, w * c)))
    bh_tile = max(1, tile_elements // max(1, g * w * c)) if g_tile == g else 1
    on_cpu = inp.keys.device.type == "cpu"  # softmax(out=input) and the mask as a bias: relied on on CPU only
    # What each query may see: [BH, W, C], or [BH, 1, C] where only padding is hidden; None: all.
    seen = visible if visible is not None else valid[:, None, :] if masked else None
    empty = no_slot if no_slot is not None and bool(no_slot.any()) else None  # queries that see no slot
    buf = None

    def tile(b0: int, b1: int, g0: int, g1: int, k_tile: torch.Tensor, bias: torch.Tensor | None) -> None:
        nonlocal buf
        q_tile = q[b0:b1, g0:g1].reshape(b1 - b0, -1, d)
        if q_tile.dtype == torch.float32:
            if buf is None:
                buf = q_tile.new_empty(bh_tile, g_tile * w, c)
            logits = torch.bmm(q_tile, k_tile, out=buf[: b1 - b0, : (g1 - g0) * w])
        else:
            logits = torch.bmm(q_tile, k_tile).float()  # float64: softmax in float32 too
        logits = logits.view(b1 - b0, g1 - g0, w, c)
        if bias is not None:
            logits.add_(bias[:, None])
        elif seen is not None:
            logits.masked_fill_(~seen[b0:b1, None], float("-inf"))
        if reduce_first:
            reduce = torch.amax if group_reduce == "max" else torch.mean
            logits = reduce(logits, dim=1, keepdim=True) if group_reduce != "sum" else logits.sum(1, keepdim=True)
        probs = torch.softmax(logits, dim=-1, out=logits) if on_cpu else torch.softmax(logits, dim=-1)
        if empty is not None:  # their softmax is NaN; any other NaN is an overflow, left for the guard
            probs = probs.masked_fill_(empty[b0:b1, None, :, None], 0.0)
        # The window reduction as one batched mat-vec that reads the tile once.
        out = scores[b0:b1, 0:1] if reduce_first else scores[b0:b1, g0:g1]
        out.copy_(torch.matmul(weights[b0:b1, None, None, :], probs).squeeze(-2))

    for b0 in range(0, bh, bh_tile):
        b1 = min(bh, b0 + bh_tile)
        k_tile = keys[b0:b1].transpose(1, 2)
        if upcast_keys:
            k_tile = k_tile.float()  # once per tile of KV heads, shared by its query heads
        # On CPU the mask is a bias added to the logits, 1 - 1/seen: 0 where a query sees a slot,
        # -inf where not, several times cheaper there than masked_fill_ with a bool mask. Not on a
        # GPU, where masked_fill_ is cheap and the overflow check below would synchronise each tile.
        bias = None
        if seen is not None and on_cpu:
            bias = torch.rsub(seen[b0:b1].view(torch.uint8).float().reciprocal_(), 1.0)
        for g0 in range(0, g, g_tile):
            g1 = min(g, g0 + g_tile)
            tile(b0, b1, g0, g1, k_tile, bias)
            out = scores[b0:b1, 0:1] if reduce_first else scores[b0:b1, g0:g1]
            if bias is not None and bool(out.isnan().any()):
                # A hidden logit that overflowed (+inf) turns NaN under the bias where masked_fill_
                # would have hidden it: the tile again as masked_fill_ gives it, for every input.
                tile(b0, b1, g0, g1, k_tile, None)
    return scores.view(b, hkv, g_out, c)


def query_attention(
    inp: EvictionInput,
    rows: slice = slice(None),
    *,
    queries: torch.Tensor | None = None,
    group_reduce: Literal["mean", "max", "sum"] = "mean",
) -> torch.Tensor:
    """``[R, Hkv, W, N]``: each window query's own attention to each slot of ``rows``, its
    softmax over the valid slots it can see (position at most its own: causal), the ``G`` query
    heads of a KV head reduced per query. Queries outside ``queries`` (``[B, W]`` bool, default
    ``inp.query_valid``) weigh 0 everywhere. Softmax in float32 whatever the cache dtype (the
    logits of float64 inputs are formed in float64 first), as ``window_attention``'s.

    For stages that need each query apart (a per-query threshold, a reduction over the group
    before the window's); ``window_attention`` sums over the window without forming this tensor.
    It holds ``[R, Hkv, G, W, N]`` logits: tile ``rows`` to bound the memory.
    """
    keys = inp.keys[rows]
    r, hkv, n, d = keys.shape
    g, w = inp.group_size, inp.queries.shape[2]
    dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32  # never multiply in half precision
    q = inp.queries[rows].to(dtype).reshape(r, hkv, g, w, d) * (1.0 / math.sqrt(d))
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys.to(dtype)).float()  # softmax in float32, as the spec's
    qpos = inp.query_positions
    chosen = inp.query_valid if queries is None else queries & inp.query_valid
    visible = (
        inp.slot_valid[rows][:, :, None, :]
        & (inp.positions[rows][:, :, None, :] <= qpos[rows].to(keys.device)[:, None, :, None])
        & chosen[rows].to(keys.device)[:, None, :, None]
    )  # [R, Hkv, W, N]
    probs = torch.softmax(logits.masked_fill_(~visible[:, :, None], float("-inf")), dim=-1)
    if group_reduce == "max":
        reduced = probs.amax(2)
    else:
        reduced = probs.mean(2) if group_reduce == "mean" else probs.sum(2)
    return reduced.nan_to_num_(0.0)  # a query that sees no slot weighs nothing


def odd_kernel(kernel: int) -> int:
    """``kernel``, refused at load unless odd: ``_pool`` pads ``kernel // 2`` on each side."""
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd so the pooled scores stay aligned, got {kernel}")
    return kernel


def _pool(scores: torch.Tensor, kind: str, kernel: int) -> torch.Tensor:
    """1-D pooling along the last (token) axis, stride 1, zero padding ``kernel // 2``."""
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if kind == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=True)
    else:
        # Scores are non-negative, so zero padding equals max_pool1d's implicit -inf padding.
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    return pooled.reshape(shape)
