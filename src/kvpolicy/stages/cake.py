"""CAKE (arXiv 2503.12491; antgroup/cakekv): each layer's budget from the dispersion and shift
of its attention on the prompt, and its token score, the window attention's mean plus its
variance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, ClassVar

import torch
from pydantic import AfterValidator, Field

from .attention import _pool, odd_kernel
from .base import Allocation, EvictionInput, Scorer


def window_probabilities(inp: EvictionInput) -> torch.Tensor:
    """``[B, Hkv, G, W, N]`` float32: each window query's softmax over every valid slot it sees
    (position at most its own: causal), 0 elsewhere and for window entries without a query."""
    b, hkv, n, d = inp.keys.shape
    g, w = inp.group_size, inp.queries.shape[2]
    qpos = inp.query_positions
    q = inp.queries.float().view(b, hkv, g, w, d) / math.sqrt(d)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, inp.keys.float())
    visible = inp.slot_valid[:, :, None, :] & (inp.positions[:, :, None, :] <= qpos.to(inp.positions.device)[:, None, :, None])
    visible = visible & inp.query_valid.to(visible.device)[:, None, :, None]  # [B, Hkv, W, N]
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a query that sees nothing: no mass


class CakeAllocation(Allocation):
    """Layer budgets in proportion to each layer's preference for cache, from its prompt.

    Per layer, from the window's queries (``schedule.window``, CAKE's ``S_w`` = 32) on the slots
    before the window (every row of the batch and every query head summed): the dispersion
    ``H = -sum A log(A + 1e-10)`` and the shift ``V``, the sum over slots of the (unbiased)
    variance over the window's queries; the preference is ``P = H^(1/tau1) V^(1/tau2)``. Each
    layer keeps the recent buffer plus ``P_l / sum P x (budget - recent) x layers`` scored slots
    (truncated to ints), capped at the slots before the window, the excess and the rounding
    spread over the layers below the cap as CAKE's ``adjust_budgets`` does, and at least one.
    Decided once, before the first eviction, when every layer holds the prompt.
    """

    type_name: ClassVar[str] = "cake"
    reads_values: ClassVar[bool] = False
    from_prompt: ClassVar[bool] = True

    tau1: float = Field(1.0, gt=0.0, le=1e3, allow_inf_nan=False, description="Dispersion's temperature (H^(1/tau1)).")
    tau2: float = Field(1.0, gt=0.0, le=1e3, allow_inf_nan=False, description="Shift's temperature (V^(1/tau2)).")

    def preference(self, inp: EvictionInput) -> float:
        """``H^(1/tau1) V^(1/tau2)`` of one layer (every row summed), in float64."""
        dispersion, shift = self._dispersion_shift(inp)
        return float(dispersion ** (1 / self.tau1) * shift ** (1 / self.tau2))

    def _log_preference(self, inp: EvictionInput) -> float:
        """``log P`` of one layer (``-inf`` for ``P = 0``): its preference where ``P`` itself
        overflows float64 (a small ``tau`` raises a dispersion above 1 to a huge power)."""
        dispersion, shift = (float(x) for x in self._dispersion_shift(inp))
        if dispersion <= 0 or shift <= 0:
            return float("-inf")
        return math.log(dispersion) / self.tau1 + math.log(shift) / self.tau2

    def _dispersion_shift(self, inp: EvictionInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``H`` and ``V`` of one layer (float64 scalars, at least 0)."""
        probs = window_probabilities(inp).double()  # [B, Hkv, G, W, N]
        device = inp.positions.device
        qpos = inp.query_positions.to(device).masked_fill(~inp.query_valid.to(device), 1 << 62)
        first = qpos.amin(-1)  # [B]: the window's first token
        before = inp.slot_valid & (inp.positions < first[:, None, None])  # slots before the window
        a = probs * before[:, :, None, None, :]
        dispersion = -(a * torch.log(a + 1e-10)).sum()
        rows = inp.query_valid.to(a.device)[:, None, None, :, None]
        count = rows.sum(3, keepdim=True).clamp_min(2)
        mean = (a * rows).sum(3, keepdim=True) / count
        shift = (((a - mean) * rows) ** 2).sum(3).div(count.squeeze(3) - 1).sum()
        return dispersion.clamp_min(0), shift.clamp_min(0)

    def prompt_budgets(self, budget: int, recent: int, inputs: Sequence[EvictionInput]) -> list[int]:
        layers = len(inputs)
        prefs = [self.preference(inp) for inp in inputs]
        total = (budget - recent) * layers
        held = max(int(inp.slot_valid.sum(-1).max()) for inp in inputs)
        cap = max(held - recent, budget - recent)  # CAKE caps at the slots before the window
        if not math.isfinite(sum(prefs)):
            # P overflowed (inf, or inf x 0 = nan): the same proportions from log P, the largest 1
            logs = [self._log_preference(inp) for inp in inputs]
            prefs = [math.exp(x - max(logs)) for x in logs] if max(logs) > float("-inf") else [0.0] * layers
        if not sum(prefs) > 0:  # no attention outside the window anywhere: the uniform share
            return [budget] * layers
        shares = [int(p / sum(prefs) * total) for p in prefs]
        return [recent + s for s in adjust_budgets(shares, total, cap)]


def adjust_budgets(shares: list[int], total: int, cap: int) -> list[int]:
    """CAKE's ``adjust_budgets``: each share capped at ``cap``, the excess spread evenly over the
    shares below the cap (the remainder to the first of them), then the total restored by adding to
    the shares below the cap or taking from those above 1, the same way; and at least 1 each."""
    excess = sum(max(s - cap, 0) for s in shares)
    shares = [min(s, cap) for s in shares]
    if excess > 0:
        _spread(shares, excess, [i for i, s in enumerate(shares) if s < cap])
    diff = total - sum(shares)
    if diff > 0:
        _spread(shares, diff, [i for i, s in enumerate(shares) if s < cap])
    elif diff < 0:
        _spread(shares, diff, [i for i, s in enumerate(shares) if s > 1])
    for i, s in enumerate(shares):  # a layer keeps a candidate: take it from the largest
        if s < 1:
            j = max(range(len(shares)), key=lambda k: shares[k])
            shares[j] -= 1 - s
            shares[i] = 1
    return shares


def _spread(shares: list[int], amount: int, where: list[int]) -> None:
    if not where:
        return
    step, rest = divmod(abs(amount), len(where))
    sign = 1 if amount > 0 else -1
    for k, i in enumerate(where):
        shares[i] += sign * (step + (1 if k < rest else 0))


class CakeScorer(Scorer):
    """CAKE's token score: over the window's queries, the mean of each slot's attention plus
    ``gamma`` times its (unbiased) variance (the shift a token sees), average-pooled with
    ``kernel``, averaged over the query heads of the KV head. Each query's softmax runs over
    every slot it sees (causal), as the window rows of CAKE's prefill attention do."""

    type_name: ClassVar[str] = "cake_attention"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True

    gamma: float = Field(200.0, ge=0.0, le=1e9, allow_inf_nan=False, description="Weight of the variance.")
    kernel: Annotated[int, AfterValidator(odd_kernel)] = Field(
        5, ge=1, le=1023, description="Average-pooling kernel (odd), stride 1, zero padding."
    )

    def score(self, inp: EvictionInput) -> torch.Tensor:
        probs = window_probabilities(inp)  # [B, Hkv, G, W, N]
        rows = inp.query_valid.to(probs.device)[:, None, None, :, None].float()
        count = rows.sum(3).clamp_min(1)
        mean = (probs * rows).sum(3) / count
        var = (((probs - mean[:, :, :, None]) * rows) ** 2).sum(3) / (count - 1).clamp_min(1)
        c = inp.num_candidates
        scores = _pool((mean + self.gamma * var)[..., :c].contiguous(), "avg", self.kernel).mean(2)
        out = scores.new_zeros(inp.batch, inp.num_kv_heads, inp.num_slots)
        out[..., :c] = scores
        return out
