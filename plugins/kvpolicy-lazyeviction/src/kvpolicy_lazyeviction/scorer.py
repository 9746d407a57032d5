"""The LazyEviction scorer: a stage that keeps state (plugin contract 4).

Each cached token carries two numbers across evictions, per KV head: the step at which its
attention last exceeded a threshold (its last *recurrence*) and the longest gap it has shown
between two recurrences (its *maximum recurrence interval*, MRI). A token quiet for longer than its
MRI is unlikely to recur and is evicted first; one still inside its MRI is kept, however long
ago it was last attended.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from kvpolicy import EvictionInput, Scorer
from kvpolicy.stages import StateField
from kvpolicy.stages.attention import query_attention

# --8<-- [start:fields]
#: ``last``: the token index of the query that last attended the token above the threshold; a
#: token's arrival counts as its first recurrence, so it starts at the token's own position
#: (``initial="position"``, contract 4; float32 holds token indices exactly up to 2**24).
#: ``mri``: the longest gap, in tokens, between two recurrences. ``now`` (per head): the newest
#: query seen (-1: none yet).
STATE = {
    "last": StateField(torch.float32, "position"),
    "mri": StateField(torch.float32, 0.0),
    "now": StateField(torch.float32, -1.0, per="head"),
}
# --8<-- [end:fields]


# --8<-- [start:stage]
class LazyEvictionScorer(Scorer):
    """LazyEviction's recurrence tracking and MRI-centric ranking (arXiv 2506.15969).

    State, updated by every query in time order (``state_updates = "every_query"``): a query at
    token index ``t`` *recurs* token ``j`` when its attention to ``j`` (softmax over every token
    it saw at its own step, the ``G`` query heads of the KV head reduced by ``group_reduce``)
    exceeds ``threshold``; then ``mri_j = max(mri_j, t - last_j)`` and ``last_j = t``.

    Score at an eviction, with ``now`` the newest query's index:
    ``1 - (now - last_j) / (mri_j + 1)``: positive while a token has been quiet for at most its
    MRI, zero or negative once it has been quiet for longer, so every such token ranks below
    every token still inside its MRI; within each group, the less of its MRI a token has used,
    the higher.
    """

    type_name: ClassVar[str] = "lazyeviction"
    reads_queries: ClassVar[bool] = True
    state_updates: ClassVar[Literal["every_query", "eviction"]] = "every_query"

    threshold: float = Field(
        1e-4, gt=0.0, lt=1.0, allow_inf_nan=False,
        description="Attention (a probability, in (0, 1)) above which a query recurs a token.",
    )
    group_reduce: Literal["max", "mean"] = Field(
        "max", description="How the G query heads of a KV head combine their attention before the threshold."
    )
    tile_elements: int = Field(
        1 << 22, ge=1, le=1 << 28,
        description="Attention weights computed per tile (performance only; results do not depend on it).",
    )

    @property
    def may_be_negative(self) -> bool:
        return True

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return STATE

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        state = inp.state_of(self)
        new = (inp.query_new & inp.query_valid).to(inp.keys.device)
        qpos = inp.query_positions.to(inp.keys.device)
        b, hkv, n, _ = inp.keys.shape
        g, w = inp.group_size, inp.queries.shape[2]
        last = torch.empty_like(state["last"])
        mri = torch.empty_like(state["mri"])
        per_row = max(1, hkv * g * w * n)
        rows = max(1, self.tile_elements // per_row)
        for b0 in range(0, b, rows):  # bounded memory: [rows, Hkv, G, W, N] at a time
            r = slice(b0, min(b, b0 + rows))
            # a query's own attention above the threshold (> 0: a slot it cannot see never recurs)
            hits = query_attention(inp, r, queries=new, group_reduce=self.group_reduce) > self.threshold
            last[r], mri[r] = _track(hits, qpos[r], inp.positions[r], state["last"][r], state["mri"][r])
        newest = torch.where(new, qpos, -1).amax(-1, keepdim=True) if w else qpos.new_full((b, 1), -1)
        now = torch.maximum(state["now"], newest.to(state["now"].dtype).expand(b, hkv))
        return {"last": last, "mri": mri, "now": now}

    def score(self, inp: EvictionInput) -> torch.Tensor:
        state = inp.state_of(self)
        quiet = (state["now"][..., None] - state["last"]).clamp_min(0.0)
        scores = 1.0 - quiet / (state["mri"] + 1.0)
        return torch.where(inp.candidate_mask, scores, torch.zeros_like(scores)).float()
# --8<-- [end:stage]


def _track(
    hits: torch.Tensor, qpos: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, mri: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence tracking over the window, query by query in time order, for every slot at once.

    ``hits [R, Hkv, W, N]``; ``qpos [R, W]``; ``positions``, ``last`` and ``mri`` ``[R, Hkv, N]``.
    Each hit's interval is measured from the slot's previous recurrence: the latest earlier hit
    in the window (a running max over it), or ``last`` before the window (the token's own
    position until its first recurrence). Token indices are exact in the state's float32 up to
    2**24."""
    dtype = last.dtype
    if hits.shape[2] == 0:
        return last, mri
    hits = hits.transpose(2, 3).contiguous()  # [R, Hkv, N, W]: the running max along the last axis is ~3x faster
    at = qpos.to(dtype)[:, None, None, :].expand(hits.shape)
    hit_at = torch.where(hits, at, -math.inf)
    previous = hit_at.cummax(dim=-1).values.roll(1, dims=-1)  # the latest hit strictly before each query
    previous[..., 0] = -math.inf
    previous = torch.maximum(previous, last[..., None])
    interval = torch.where(hits, at - previous, 0.0)
    new_mri = torch.maximum(mri, interval.amax(-1))
    new_last = torch.maximum(last, hit_at.amax(-1))
    # Padding slots (position -1) keep what they had: nothing reads them.
    valid = positions >= 0
    return torch.where(valid, new_last, last), torch.where(valid, new_mri, mri)
