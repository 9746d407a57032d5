"""Attention of the current step's query: the oracle that selection-based sparse attention
approximates."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer


def newest_query(inp: EvictionInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's newest valid window query ``[B, Hq, D]`` and whether the row has one ``[B]``."""
    valid = inp.query_valid
    w = valid.shape[1]
    last = (w - 1) - valid.flip(-1).long().argmax(-1)  # index of the last True (0 when none)
    rows = torch.arange(valid.shape[0], device=valid.device)
    return inp.queries[rows, :, last.to(inp.queries.device)], valid.any(-1)


class CurrentAttentionScorer(Scorer):
    """The exact attention mass each slot gets from the current step's query.

    The current query is each row's newest valid window entry (in select mode, the query of the
    step being decoded). ``softmax(q K^T / sqrt(D))`` over every valid slot (recent ones
    included, so the mass is the true attention of this step), in float32, then reduced over the
    ``G`` query heads of each KV head (``group_reduce``). Greedy top-k over it is *oracle top-k*
    selection. A row without any query scores 0 everywhere.

    ``head_reduce: layer`` reduces over all ``Hq`` query heads of the layer instead (with
    ``group_reduce``'s mean or max) and gives every KV head that one score (TOVA): each head's
    row of scores is the same tensor, bit for bit, so greedy selection, which ranks each row
    with one deterministic ``topk``, keeps the same slots in every head, ties included, as long
    as the heads hold the same slots (which a policy that only ever keeps the same slots in
    every head maintains; heads that hold different tokens are refused at the eviction,
    ``EvictionInput.require_same_tokens_in_every_head``). It couples the heads
    (``couples_heads``): a shard of them cannot choose alone, so it is refused under tensor
    parallelism.
    """

    type_name: ClassVar[str] = "current_attention"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True

    group_reduce: Literal["mean", "max"] = "mean"
    head_reduce: Literal["group", "layer"] = Field(
        "group",
        description="group: reduce the G query heads of each KV head; layer: reduce all query heads of the "
        "layer and give every KV head the same score (one decision per layer, as in TOVA).",
    )

    @property
    def couples_heads(self) -> bool:
        return self.head_reduce == "layer"

    @property
    def combines_heads(self) -> bool:
        return self.head_reduce == "layer"

    @property
    def heads_alike(self) -> bool:
        return self.head_reduce == "layer"

    def score(self, inp: EvictionInput) -> torch.Tensor:
        if self.head_reduce == "layer":
            inp.require_same_tokens_in_every_head(self)
        return self.attention_mass(inp, every_slot_valid=False)

    def score_packed(self, inp: EvictionInput) -> torch.Tensor:
        """``score`` on select mode's packed rows (``Scorer.score_packed``, oracle top-k): one
        ``q . K`` pass over the keys, without the masks and without checking that the heads
        hold the same tokens (every slot is valid, every head holds every token). Always scores."""
        return self.attention_mass(inp, every_slot_valid=True)

    def attention_mass(self, inp: EvictionInput, *, every_slot_valid: bool) -> torch.Tensor:
        """``score``: ``[B, Hkv, N]`` float32 (NaN where ``q . k`` overflowed float32: the guard
        reports it). ``every_slot_valid``: the caller knows ``inp.slot_valid`` is all True (a select-mode
        cache's packed rows: every head holds every token), so the mask is not applied, nor are
        the heads checked for holding the same tokens: the same numbers, one pass fewer."""
        b, hkv, n, d = inp.keys.shape
        q, has_query = newest_query(inp)
        q = q.float().view(b, hkv, inp.group_size, d) * d**-0.5
        logits = torch.matmul(q, inp.keys.float().transpose(-1, -2))  # [B, Hkv, G, N]: the one pass over the keys
        if not every_slot_valid:
            logits.masked_fill_(~inp.slot_valid[:, :, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if not every_slot_valid:
            # A row and head of padding only has no mass (its softmax is NaN). Other NaN or inf,
            # from logits that overflowed float32, stay for the guard to report.
            has_slot = inp.slot_valid.any(-1)  # [B, Hkv]
            probs.masked_fill_(~has_slot[:, :, None, None], 0.0)
        dims = (1, 2) if self.head_reduce == "layer" else (2,)
        scores = probs.amax(dims) if self.group_reduce == "max" else probs.mean(dims)
        if self.head_reduce == "layer":  # [B, N]: one row of scores, copied to every KV head
            scores = scores[:, None, :].expand(b, hkv, n).contiguous()
        return torch.where(has_query[:, None, None], scores, 0.0)
