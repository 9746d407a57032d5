"""CaM (cache merging, ICML 2024; kvpress ``CAMPress``): an evicted token's value folded into the
kept tokens that follow it, under a Bernoulli draw from its accumulated attention."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import Field, field_validator

from ..documents import PolicyWarning
from .accumulated_attention import AccumulatedAttentionScorer
from .base import EvictionInput, Merge, MergeResult, Scorer, StateField
from .spec import ScorerSpec

if TYPE_CHECKING:
    from ..schedule import Schedule

_BOUNDED = {"mass": StateField(torch.float32, 1.0)}  # 1, plus the weight of every share received
_ATTENTION = {"absorbed": StateField(torch.float32, 0.0)}  # the attention mass of every share received


@dataclass(frozen=True)
class _Spread:
    """What the window slots of an eviction receive (``CamMerge._spread``), by rank among them.

    ``slots [B, Hkv, R]``: each rank's slot (0 at a padding rank), ``present [B, Hkv, R]`` bool:
    a real rank; ``num [B, Hkv, R, Dv]``: the sum of ``share * v_i`` it received; ``den``, ``hit
    [B, Hkv, N]``: by slot, the sum of shares and whether any arrived (counted, not summed, so
    exact)."""

    slots: torch.Tensor
    present: torch.Tensor
    num: torch.Tensor
    den: torch.Tensor
    hit: torch.Tensor

    def targets_of(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Hkv, N, ...]`` at each rank's slot: ``[B, Hkv, R, ...]`` (slot 0's at padding ranks)."""
        if x.dim() == 3:
            return x.gather(-1, self.slots)
        return x.gather(2, self.slots[..., None].expand(*self.slots.shape, x.shape[-1]))

    def written(self, values: torch.Tensor, merged: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
        """``values`` as float32 with ``merged [B, Hkv, R, Dv]`` written over the slots ``changed
        [B, Hkv, N]`` says (every other slot's value exactly as it was)."""
        out = values.to(torch.float32, copy=True)
        take = self.present & changed.gather(-1, self.slots)
        out[take.nonzero(as_tuple=True)[:2] + (self.slots[take],)] = merged[take].to(torch.float32)
        return out


class CamMerge(Merge):
    """Each evicted token ``i`` may merge into its window: the ``merge_budget`` kept slots of its
    row and KV head that follow it in position order (fewer near the end; none: no merge).

    It merges with probability ``p_i = clamp(A_i / mean(A over the window), 0, 1)`` (``A``: the
    attention each token has accumulated, the state of the nested ``attention`` scorer; NaN
    counts as 0, inf as 1). What it merges depends on ``mass``:

    - ``attention`` (the default; a departure from CaM): shares weigh what attention weighs. The
      window holds kept slots outside the recent buffer only (slots ``[0, num_candidates)``: a
      recent slot's ``A`` counts the few queries since it arrived, not comparable with an older
      token's). Token ``i`` gives each slot of its window the weight ``s = A_i / |window|``; a slot
      ``t`` carries the attention mass it has absorbed, ``M_t`` (state ``absorbed``, 0 for a fresh
      token), weighs ``A_t + M_t`` (its own accumulated attention plus that) and becomes ``((A_t
      + M_t) v_t + sum s v_i) / (A_t + M_t + sum s)``, with ``M_t`` growing by ``sum s``. What a
      slot absorbs is capped: ``M_t <= max_absorbed * A_t`` (the shares it receives are scaled down
      to the room left). A heavy hitter, attended for its own key, so keeps dominating its value,
      and every value stays a convex combination of what it absorbed.
    - ``faithful`` (CaM's rule, kvpress's ``CAMPress``): ``v_i / |window|`` is added to every
      value of the window. Nothing renormalises it, so under eviction every ``interval`` tokens a
      kept slot receives shares at every eviction and its value grows with their number; loading
      it warns (``PolicyWarning``).
    - ``bounded`` (the default until 2026-12-05; a departure from CaM): each slot carries its mass
      ``m`` (state ``mass``: 1 for a fresh token, plus the weight of every share it has received). As in CaM,
      token ``i``'s value goes out with a total weight of 1, split evenly over its window (``w =
      1 / |window|`` to each slot); a slot ``t`` becomes ``(m_t v_t + sum w v_i) / (m_t + sum w)``
      and its mass ``m_t + sum w``. Every value stays a convex combination of the values it
      absorbed, and a slot that absorbed many tokens weighs them against newcomers. An evicted
      token weighs 1 however much it had absorbed (what it absorbed is already inside its value):
      carrying its mass along instead moves the mass of long chains of merges into the slots
      after them, which measured worse (perplexity ratio 1.77 against 1.32 at budget 128, eight seeds).

    On the ranking protocol every rule here is behind ``h2o``'s eviction without a merge, and the
    less a rule merges the nearer it comes (``docs/findings.md``): ``attention``'s cap keeps
    ``cam`` near ``h2o`` while it still merges.

    ``A`` is read from ``attention`` (default ``accumulated_attention`` with ``group_reduce:
    sum``, H2O's scorer as the ``h2o`` and ``cam`` policies write it). Equal stages of a policy
    share one state, so where the policy's scorer is that same stage the merge reads the
    scorer's accumulated attention and nothing is accumulated twice. The probability is a ratio
    of two sums over one head, so ``sum`` and ``mean`` give the same ``p`` up to rounding.

    Keys are unchanged (RoPE-safe); slots nothing merged into keep their values exactly.

    Departures from kvpress's ``CAMPress``, by design: the Bernoulli draws come from each row's
    seeded stream (``inp.head_uniform``, stream ``"cam"``), not from torch's global generator, so a
    row's merges are reproducible and independent of the batch; every token the eviction drops
    is a candidate (kvpress takes the ``k`` highest-scoring evicted, ``k`` the tokens added since
    the last compression, which on a schedule of evictions every ``interval`` tokens is all of
    them); and each KV head merges over its own kept set (kvpress averages the scores over the
    heads so that all keep the same slots; a policy with a head-shared scorer does the same).
    ``A`` counts every query the state has seen, prompt queries included.
    """

    type_name: ClassVar[str] = "cam"
    stochastic: ClassVar[bool] = True
    #: The merge's own state (``mass``) changes only when tokens merge.
    state_updates: ClassVar[Literal["every_query", "eviction"]] = "eviction"

    merge_budget: int = Field(32, ge=1, le=1 << 20, description="Kept slots each evicted token merges into (>= 1).")
    mass: Literal["attention", "bounded", "faithful"] = Field(
        "attention",
        description="attention (the default): each value the attention-mass-weighted mean of its own and what it "
        "absorbed, windows outside the recent buffer, the absorbed mass capped by max_absorbed; bounded: the "
        "token-count-weighted mean; faithful: CaM's v_t += v_i / |window|, which grows under repeated evictions.",
    )
    max_absorbed: float = Field(
        0.02, gt=0.0, le=1e6, allow_inf_nan=False,
        description="mass: attention only: the attention mass a kept slot may absorb, as a fraction of its own "
        "accumulated attention (0.02: at most 1/51 of a value comes from evicted tokens' shares at a merge).",
    )
    attention: ScorerSpec = Field(
        default_factory=AccumulatedAttentionScorer,
        description="The accumulated_attention scorer whose state is A (shared with an equal scorer of the policy).",
    )

    @field_validator("attention")
    @classmethod
    def _accumulated(cls, value: Scorer) -> Scorer:
        if not isinstance(value, AccumulatedAttentionScorer):
            raise ValueError(
                f"attention must be an accumulated_attention scorer (its state is CaM's A), got {value.type_name!r}"
            )
        return value

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return {"attention": _ATTENTION, "bounded": _BOUNDED}.get(self.mass, {})

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        return dict(inp.state_of(self))  # the mass changes only when tokens merge (``merge``)

    def validate_schedule(self, schedule: Schedule) -> None:
        if self.mass == "faithful":
            warnings.warn(
                f"merge cam with mass: faithful adds v_i / |window| to kept values at every eviction (every "
                f"{schedule.interval} slots past the budget of {schedule.budget}) and nothing renormalises them: "
                "under decode-time eviction each kept slot absorbs shares again and again and its value grows with "
                "the number of evictions (perplexity ratios of 60-3,300 over 4,096 tokens on the bundled model). "
                "Use mass: attention (the default) for decoding; faithful is for parity with CaM and kvpress's "
                "CAMPress.",
                PolicyWarning, stacklevel=2,
            )

    def merge_probability(self, inp: EvictionInput, keep: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, N]`` float32: each evicted slot's merge probability (0 elsewhere)."""
        return self._windows(inp, keep)[2]

    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        u = inp.head_uniform(inp.num_slots, stream=self.type_name)  # [B, Hkv, N] in (0, 1)
        draws = u < self.merge_probability(inp, keep)
        if self.mass == "faithful":
            return MergeResult(self.merge_with(inp, keep, draws), {})
        if self.mass == "attention":
            values, absorbed = self.merge_attention(inp, keep, draws)
            return MergeResult(values, {"absorbed": absorbed})
        values, mass = self.merge_bounded(inp, keep, draws)
        return MergeResult(values, {"mass": mass})

    def merge_with(self, inp: EvictionInput, keep: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """CaM's faithful rule: the merged values ``[B, Hkv, N, Dv]`` float32 when ``draws [B, Hkv,
        N]`` bool says which evicted slots merge (their Bernoulli outcomes; read on evicted slots
        with a window only): the draw is the only random part, so a test may hand it kvpress's mask."""
        spread = self._spread(inp, keep, draws, torch.ones(inp.values.shape[:3], dtype=torch.float32,
                                                           device=inp.values.device))
        v = spread.targets_of(inp.values.float())
        return spread.written(inp.values, v + spread.num.float(), spread.hit)

    def merge_bounded(
        self, inp: EvictionInput, keep: torch.Tensor, draws: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounded rule given the draws (as ``merge_with``): ``(values [B, Hkv, N, Dv] float32,
        mass [B, Hkv, N] float32)``, each kept value the mass-weighted mean of its own and the
        shares it receives, each evicted token's weight 1 split evenly over its window."""
        mass = inp.state_of(self)["mass"].double()
        spread = self._spread(inp, keep, draws, torch.ones_like(mass))  # each token weighs 1 in all
        m, den = spread.targets_of(mass), spread.targets_of(spread.den)
        v = spread.targets_of(inp.values).double()
        merged = (m[..., None] * v + spread.num) / (m + den)[..., None]
        return spread.written(inp.values, merged, spread.hit), torch.where(spread.hit, mass + spread.den, mass).float()

    def merge_attention(
        self, inp: EvictionInput, keep: torch.Tensor, draws: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention rule given the draws (as ``merge_with``): ``(values [B, Hkv, N, Dv]
        float32, absorbed [B, Hkv, N] float32)``. Each merging token gives each slot of its window
        (kept slots outside the recent buffer) ``A_i / |window|``; a slot's receipts are scaled
        down to its room ``max_absorbed * A_t - M_t``, and it becomes the mean of its value
        (weight ``A_t + M_t``) and the shares, its ``M_t`` growing by what it took."""
        a = inp.state_of(self.attention)["attention"].double()
        absorbed = inp.state_of(self)["absorbed"].double()
        spread = self._spread(inp, keep, draws, a)  # each token gives A_i in all
        room = (self.max_absorbed * a - absorbed).clamp_min(0.0)
        scale = torch.where(spread.den > room, room / spread.den.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
        den = spread.den * scale
        own = a + absorbed
        took = spread.hit & (den > 0)
        num = spread.num * spread.targets_of(scale)[..., None]
        own_t, den_t = spread.targets_of(own), spread.targets_of(den)
        v = spread.targets_of(inp.values).double()
        merged = (own_t[..., None] * v + num) / torch.where(spread.targets_of(took), own_t + den_t, 1.0)[..., None]
        return spread.written(inp.values, merged, took), torch.where(took, absorbed + den, absorbed).float()

    def _spread(
        self, inp: EvictionInput, keep: torch.Tensor, draws: torch.Tensor, weight: torch.Tensor,
    ) -> _Spread:
        """Each merging token ``i`` (evicted, with a window, drawn) gives every slot of its window
        ``weight_i / |window|``: what each window slot receives, in ``weight``'s dtype (``_Spread``).

        A range-add over the window slots' ranks: ``+ share`` at a window's first rank, ``- share``
        past its last, then a prefix sum. Only the merging tokens' and the window slots' values are
        read (a third of the slots at an eviction each ``interval``), in the order a dense
        scatter over every slot would add them, so the sums are the same bit for bit."""
        b, h, n, dv = inp.values.shape
        start, width, _, order = self._windows(inp, keep)
        targets_s = self._targets(inp, keep).gather(-1, order)
        merging = inp.slot_valid & ~keep & (width > 0) & draws
        share = torch.where(merging, weight / width.clamp_min(1).to(weight.dtype), 0.0)  # [B, Hkv, N]
        # The window slots by rank (their position order), and the merging tokens by slot index.
        ranks = int(targets_s.sum(-1).max()) if targets_s.numel() else 0
        by_rank = order.gather(-1, (~targets_s).int().argsort(dim=-1, stable=True)[..., :ranks])  # [B, Hkv, ranks]
        present = torch.arange(ranks, device=keep.device) < targets_s.sum(-1, keepdim=True)
        movers = int(merging.sum(-1).max()) if merging.numel() else 0
        src = (~merging).int().argsort(dim=-1, stable=True)[..., :movers]  # [B, Hkv, movers]
        moving = merging.gather(-1, src)
        lo = torch.where(moving, start.gather(-1, src), ranks + 1)  # ranks + 1: a sink for padding entries
        hi = torch.where(moving, (start + width).gather(-1, src), ranks + 1)
        s = share.gather(-1, src)
        v = inp.values.gather(2, src[..., None].expand(b, h, movers, dv)).to(weight.dtype)
        shared = torch.cat([s[..., None] * v, s[..., None]], -1)  # [B, Hkv, movers, Dv + 1]
        delta = torch.zeros(b, h, ranks + 2, dv + 1, dtype=weight.dtype, device=v.device)
        delta.scatter_add_(2, lo[..., None].expand(b, h, movers, dv + 1), shared)
        delta.scatter_add_(2, hi[..., None].expand(b, h, movers, dv + 1), -shared)
        count = torch.zeros(b, h, ranks + 2, dtype=torch.int32, device=v.device)
        count.scatter_add_(2, lo, moving.int()).scatter_add_(2, hi, -moving.int())
        added, touched = delta.cumsum(2)[:, :, :ranks], (count.cumsum(2)[:, :, :ranks] > 0) & present
        sink = torch.where(present, by_rank, n)  # padding ranks to a sink column, dropped
        den = torch.zeros(b, h, n + 1, dtype=weight.dtype, device=v.device).scatter_(-1, sink, added[..., dv])[..., :n]
        hit = torch.zeros(b, h, n + 1, dtype=torch.bool, device=v.device).scatter_(-1, sink, touched)[..., :n]
        return _Spread(torch.where(present, by_rank, 0), present, added[..., :dv], den, hit)

    def _targets(self, inp: EvictionInput, keep: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the kept slots a window may hold (under ``attention``, not the
        recent buffer's: slots ``[num_candidates, N)``)."""
        if self.mass != "attention":
            return keep
        return keep & (torch.arange(inp.num_slots, device=keep.device) < inp.num_candidates)

    def _windows(self, inp: EvictionInput, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(start, width, p, order)`` ``[B, Hkv, N]`` in slot order: the rank among the window
        slots (``_targets``, in position order) of the first one after each slot, its window's
        size, its merge probability (evicted slots; 0 elsewhere), and the slots sorted by position
        (padding last)."""
        valid, n = inp.slot_valid, inp.num_slots
        pos = torch.where(valid, inp.positions, torch.iinfo(torch.long).max)
        order = pos.argsort(dim=-1, stable=True)
        keep_s = self._targets(inp, keep).gather(-1, order)
        start_s = keep_s.long().cumsum(-1) - keep_s.long()  # kept slots before each sorted slot
        width_s = (keep_s.sum(-1, keepdim=True) - start_s).clamp(0, self.merge_budget)
        # Mean accumulated attention over each window, from prefix sums over the kept ranks (float64).
        attention = inp.state_of(self.attention)["attention"].double()
        by_rank = torch.zeros(*keep.shape[:2], n + 1, dtype=torch.float64, device=keep.device)
        rank_s = torch.where(keep_s, start_s, n)
        by_rank.scatter_(-1, rank_s, attention.gather(-1, order) * keep_s)
        prefix = torch.nn.functional.pad(by_rank[..., :n].cumsum(-1), (1, 0))
        total = prefix.gather(-1, (start_s + width_s).clamp_max(n)) - prefix.gather(-1, start_s.clamp_max(n))
        mean = total / width_s.double()
        p_s = torch.nan_to_num(attention.gather(-1, order) / mean, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
        start, width, p = (torch.empty_like(x).scatter_(-1, order, x) for x in (start_s, width_s, p_s))
        evicted = valid & ~keep & (width > 0)
        return start, width, torch.where(evicted, p, 0.0).float(), order
