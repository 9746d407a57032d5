"""Attention-free scores from lagged key and value statistics (LagKV)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Scorer

if TYPE_CHECKING:
    from ..schedule import Schedule


class LagScorer(Scorer):
    """LagKV's score (arXiv 2504.04704; official ``lag_kv.py``): each token is compared with the
    range of the *next* stretch of tokens, no attention needed.

    Per row and KV head, the held slots after the first ``sink`` are cut into partitions of
    ``lag_size`` consecutive slots. Partition ``p`` is scored against partition ``p + 1``: per
    channel, ``m`` and ``M`` are the minimum and maximum of the reference's keys, each key of
    ``p`` is normalised to ``(k - m) / (M - m)``, and ``s_K`` is the softmax, over the partition's
    tokens, of the normalised key's standard deviation over the channels (unbiased). ``s_V`` is
    the same on the values, and the score is ``s_K + score_v_ratio * s_V``, in ``(0, 1 + ratio]``.

    The last full partition (it has no reference) and the slots after it (fewer than a
    partition) form the tail; the tail and the ``sink`` first slots score above any partition's
    token, the sinks highest and the tail by recency, as the official code always keeps them.
    So when the cache holds fewer than ``sink + 2 * lag_size`` slots nothing is scored by lag,
    and greedy keeps the sinks and the newest tokens (as kvpress does there).

    With ``rank_within_partition`` (the default) each scored token's score is then replaced by its
    rank within its partition over ``lag_size`` (0 for the lowest, in ``[0, 1)``; equal ranks of
    two partitions go to the newer one), so that top-k takes the same share of every partition: the official code keeps ``ratio * lag_size`` tokens
    of each partition, and kvpress's ``LagKVPress`` ranks this way by default. Without it the raw
    scores are ranked across partitions (kvpress's ``cross_scoring``): a partition that stands out
    keeps more.

    A channel whose reference range is 0 (``M = m``) normalises to 0 instead of dividing by 0
    (the official code gives NaN there). Partitions are formed from the slots held, so after an
    eviction a partition spans the survivors of a longer stretch of tokens.
    """

    type_name: ClassVar[str] = "lag"

    lag_size: int = Field(128, ge=1, le=1 << 22, description="Slots per partition (kvpress: 128; official: 1024).")
    sink: int = Field(4, ge=0, le=1 << 24, description="First slots left out of the partitions and always ranked first.")
    score_v_ratio: float = Field(
        1.0, ge=0.0, le=1e6, allow_inf_nan=False, description="Weight of the values' score (official: 1.0)."
    )
    rank_within_partition: bool = Field(
        True, description="Score each token by its rank within its partition, so every partition keeps the same "
        "share (the official code; kvpress's default). False: raw scores ranked across partitions (kvpress's "
        "cross_scoring).",
    )

    def validate_schedule(self, schedule: Schedule) -> None:
        room = schedule.budget - schedule.recent
        if self.sink > room:  # the sinks are always kept (the spec): more than the candidates keep cannot be
            raise ValueError(
                f"scorer.sink ({self.sink}) is more than the slots the budget leaves to candidates (budget "
                f"{schedule.budget} - recent {schedule.recent} = {room}): the sinks, ranked first, could not all be kept"
            )

    def score(self, inp: EvictionInput) -> torch.Tensor:
        if inp.head_dim < 2 or inp.values.shape[-1] < 2:
            raise ValueError("scorer 'lag' takes a standard deviation over the channels: it needs head_dim >= 2")
        valid = inp.slot_valid
        b, h, n = valid.shape
        lag = self.lag_size
        rank = valid.long().cumsum(-1) - 1  # index of each slot among the held ones of its row and head
        held = valid.sum(-1, keepdim=True)
        full = (held - self.sink).clamp(min=0).div(lag, rounding_mode="floor")  # full partitions
        part = (rank - self.sink).div(lag, rounding_mode="floor")
        in_part = valid & (rank >= self.sink) & (part < full)  # slots of a full partition (scored or reference)
        scored = in_part & (part < full - 1)
        parts = n // lag + 1
        index = torch.where(in_part, part, parts - 1).clamp(0, parts - 1)  # spare bucket for the rest
        # Every slot held (packed rows, vLLM's): partition p is slots [sink + p * lag, sink + (p + 1) * lag)
        # of every row, reduced by a reshape instead of a scatter (the same minima and maxima).
        packed = (self.sink, max(n - self.sink, 0) // lag, lag) if bool(valid.all()) else None
        # No partition has a reference yet (fewer than sink + 2 * lag held): every slot is a sink or
        # the tail, whose scores below replace these, so the statistics are not computed.
        if not bool(scored.any()):
            score = torch.zeros(b, h, n, device=valid.device)
        else:
            score = self._states_score(inp.keys, index, in_part, scored, parts, packed)
            if self.score_v_ratio:
                score = score + self.score_v_ratio * self._states_score(inp.values, index, in_part, scored, parts, packed)
            if self.rank_within_partition:
                score = self._rank_within(score, index, rank - self.sink - part * lag, scored, parts)
        top = 1.0 + self.score_v_ratio
        recency = rank.float() / max(n, 1)
        tail = valid & (rank >= self.sink) & ~scored
        score = torch.where(tail, top + 1.0 + recency, score)
        score = torch.where(valid & (rank < self.sink), top + 3.0, score)
        return torch.where(valid, score, 0.0).float()

    def _rank_within(
        self, score: torch.Tensor, index: torch.Tensor, offset: torch.Tensor, scored: torch.Tensor, parts: int
    ) -> torch.Tensor:
        """``score`` with each scored slot's value replaced by its rank among the ``lag_size``
        slots of its partition, over ``lag_size``: the partitions laid out as a
        ``[B, Hkv, parts, lag_size]`` grid (a scored partition is always full), ranked along it."""
        lag = self.lag_size
        b, h, _ = score.shape
        cell = torch.where(scored, index * lag + offset, parts * lag)  # the spare cell for the rest
        grid = score.new_full((b, h, parts * lag + 1), float("-inf"))
        grid.scatter_(2, cell, torch.where(scored, score, float("-inf")))
        ranks = grid[..., :-1].unflatten(-1, (parts, lag)).argsort(dim=-1, stable=True).argsort(dim=-1, stable=True)
        ranks = torch.cat([ranks.flatten(-2), ranks.new_zeros(b, h, 1)], -1)
        # Equal ranks of different partitions go to the newer partition (a fraction below one rank):
        # top-k then never breaks a tie by its own unspecified order.
        tiebreak = index.to(score.dtype) / parts
        return torch.where(scored, (ranks.gather(2, cell).to(score.dtype) + tiebreak) / lag, score)

    @staticmethod
    def _states_score(
        x: torch.Tensor, index: torch.Tensor, in_part: torch.Tensor, scored: torch.Tensor, parts: int,
        packed: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """``[B, Hkv, N]``: per scored slot, the softmax over its partition of the std of its
        channels normalised by the next partition's per-channel range; 0 elsewhere. ``packed``:
        ``(sink, full, lag)`` when every slot is held, so the ``full`` partitions are contiguous."""
        x = x.float()
        b, h, n, d = x.shape
        if packed is not None:
            sink, full, lag = packed
            body = x[:, :, sink : sink + full * lag].unflatten(2, (full, lag))
            lo = x.new_full((b, h, parts, d), float("inf"))
            hi = x.new_full((b, h, parts, d), float("-inf"))
            lo[:, :, :full], hi[:, :, :full] = body.amin(3), body.amax(3)
        else:
            idx = index[..., None].expand(b, h, n, d)
            lo = x.new_full((b, h, parts, d), float("inf")).scatter_reduce(
                2, idx, torch.where(in_part[..., None], x, float("inf")), "amin")
            hi = x.new_full((b, h, parts, d), float("-inf")).scatter_reduce(
                2, idx, torch.where(in_part[..., None], x, float("-inf")), "amax")
        ref = (index + 1).clamp(max=parts - 1)[..., None].expand(b, h, n, d)  # the next partition
        m, top = lo.gather(2, ref), hi.gather(2, ref)
        span = top - m
        flat = span == 0
        norm = torch.where(scored[..., None] & ~flat, (x - m) / torch.where(flat, 1.0, span), 0.0)
        spread = torch.where(scored, norm.std(dim=-1), float("-inf"))
        # Softmax inside each partition.
        peak = spread.new_full((b, h, parts), float("-inf")).scatter_reduce(2, index, spread, "amax")
        ex = torch.where(scored, torch.exp(spread - peak.gather(2, index)), 0.0)
        total = ex.new_zeros(b, h, parts).scatter_add(2, index, ex)
        return torch.where(scored, ex / total.gather(2, index).clamp_min(torch.finfo(ex.dtype).tiny), 0.0)
