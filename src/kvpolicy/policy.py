"""A policy compiled from its config: one eviction over ``[B, Hkv, N, D]`` is ``Policy.select``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .config import PolicyConfig, PolicyError, apply_overrides, parse_policy, read_policy_text, read_source
from .registry import get_registry
from .schedule import Schedule
from .stages.base import EvictionInput

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class Policy:
    """Runs a policy's stages: scorer -> reservations -> selector, all rows and heads at once.

    A ``Policy`` is immutable apart from the state of its default random generator, which is
    seeded from ``config.seed`` on first use and advances with every stochastic eviction (pass
    ``generator=`` to control randomness yourself).
    """

    def __init__(self, config: PolicyConfig, source: Mapping[str, Any] | None = None) -> None:
        self.config = config
        # The mapping the config was validated from: overrides re-apply to it, so that relative
        # fields (StreamingLLM's ``recent: budget - 4``) follow an overridden budget.
        self._source = dict(source) if isinstance(source, Mapping) else None
        self._generators: dict[torch.device, torch.Generator] = {}

    # -- descriptive ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def schedule(self) -> Schedule:
        return self.config.schedule

    @property
    def budget(self) -> int:
        return self.config.schedule.budget

    @property
    def stochastic(self) -> bool:
        stages = [self.config.scorer, *self.config.reservations, self.config.selector]
        return any(s is not None and s.stochastic for s in stages)

    def __repr__(self) -> str:
        s = self.schedule
        return f"Policy({self.name!r}, budget={s.budget}, recent={s.recent}, interval={s.interval}, window={s.window})"

    def to_yaml(self) -> str:
        return self.config.to_yaml()

    def with_overrides(self, **overrides: Any) -> Policy:
        """A new policy with schedule or top-level fields replaced (``budget=512``)."""
        data = apply_overrides(self._source if self._source is not None else self.config.to_dict(), overrides)
        return Policy(parse_policy(data, self.name), data)

    def default_generator(self, device: torch.device | str) -> torch.Generator:
        """The policy's own generator on ``device``, seeded from ``config.seed`` on first use."""
        return generator_for(self._generators, device, self.config.seed)

    # -- the algorithm ----------------------------------------------------------------------
    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        slot_valid: torch.Tensor | None = None,
        query_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        layer_seed: torch.Tensor | None = None,
        rows_per_layer: int | None = None,
    ) -> torch.LongTensor:
        """One eviction: the slots to keep among the ``N`` cached ones.

        Args:
            keys: ``[B, Hkv, N, D]`` post-RoPE keys; the last ``schedule.recent`` slots are the
                recent buffer.
            values: ``[B, Hkv, N, Dv]``.
            queries: ``[B, Hq, W, D]`` the window of recent post-RoPE queries, ``Hq % Hkv == 0``.
            generator: randomness for stochastic stages (default: the policy's seeded generator).
            slot_valid: ``[B, N]`` or ``[B, Hkv, N]`` bool, False for padding (default: all True).
            query_valid: ``[B, W]`` bool, False for window entries without a real query.
            positions: ``[B, N]`` or ``[B, Hkv, N]`` long token index of each slot among its row's real tokens
                (default: ``0 .. N-1``; ``-1`` for padding).
            layer_seed: ``[L]`` long, one fixed seed per layer when the executor stacks ``L``
                layers on the batch axis (default: the policy's seed).
            rows_per_layer: batch rows per stacked layer (default: ``B``).

        Returns:
            ``[B, Hkv, K]`` long, ``K = min(N, budget)``: ascending slot indices, no duplicates,
            always containing every protected slot (recent buffer, sinks, reservations).
        """
        _check_inputs(keys, values, queries, slot_valid, query_valid, positions)
        b, hkv, n, _ = keys.shape
        device = keys.device
        if n <= self.budget:
            return torch.arange(n, device=device).expand(b, hkv, n).clone()
        if generator is None and self.stochastic:
            generator = self.default_generator(device)
        if layer_seed is None:
            layer_seed = torch.tensor([self.config.seed or 0], dtype=torch.long)
        inp = eviction_input(
            keys, values, queries, budget=self.budget, recent=self.schedule.recent,
            slot_valid=slot_valid, query_valid=query_valid, positions=positions, generator=generator,
            layer_seed=layer_seed, rows_per_layer=rows_per_layer,
        )
        return self.select_from(inp)

    def select_from(self, inp: EvictionInput) -> torch.LongTensor:
        """``select`` on an already assembled (and checked) ``EvictionInput``."""
        cfg = self.config
        b, hkv, n, k_keep = inp.batch, inp.num_kv_heads, inp.num_slots, inp.budget
        slot_idx = torch.arange(n, device=inp.keys.device)
        protected = (slot_idx >= inp.num_candidates).expand(b, hkv, n).clone()
        for reservation in cfg.reservations:
            protected |= reservation.reserve(inp, protected)
        scores = None
        if cfg.selector.needs_scores:
            scores = cfg.scorer.score(inp).float()
            if bool(torch.isnan(scores).any()):
                raise ValueError(f"scorer {cfg.scorer.type_name!r} produced NaN scores (check the inputs for NaN/inf)")
        priority = cfg.selector.priority(scores, inp).float()
        eligible = inp.candidate_mask & ~protected
        priority = torch.where(eligible, priority, float("-inf")).masked_fill_(protected, float("inf"))
        if 2 * k_keep <= n:
            kept = priority.topk(k_keep, dim=-1, sorted=False).indices
            return kept.sort(dim=-1).values
        # Keeping most slots (the usual case: N = budget + interval): find the few to drop, and
        # read the kept ones off a mask, which comes out ascending without a sort.
        drop = priority.topk(n - k_keep, dim=-1, largest=False, sorted=False).indices
        keep = torch.ones_like(priority, dtype=torch.bool).scatter_(-1, drop, False)
        return keep.nonzero()[:, -1].view(b, hkv, k_keep)


def eviction_input(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    *,
    budget: int,
    recent: int,
    slot_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    layer_seed: torch.Tensor | None = None,
    rows_per_layer: int | None = None,
) -> EvictionInput:
    """Assemble the ``EvictionInput`` of one eviction, filling the defaults ``Policy.select``
    documents (all slots and queries valid, positions ``0 .. N-1``, ``[B, N]`` masks broadcast
    over heads). Inputs are not checked here: ``Policy.select`` checks them first."""
    b, hkv, n, _ = keys.shape
    device = keys.device
    if slot_valid is None:
        slot_valid = torch.ones(b, hkv, n, dtype=torch.bool, device=device)
    elif slot_valid.dim() == 2:
        slot_valid = slot_valid[:, None, :].expand(b, hkv, n)
    if query_valid is None:
        query_valid = torch.ones(b, queries.shape[2], dtype=torch.bool, device=device)
    if positions is None:
        positions = torch.where(slot_valid, slot_valid.long().cumsum(-1) - 1, -1)
    elif positions.dim() == 2:
        positions = positions[:, None, :].expand(b, hkv, n)
    return EvictionInput(
        keys=keys,
        values=values,
        queries=queries,
        budget=min(n, budget),
        num_candidates=max(0, n - recent),
        slot_valid=slot_valid,
        query_valid=query_valid,
        positions=positions,
        generator=generator,
        layer_seed=layer_seed,
        rows_per_layer=rows_per_layer or b,
    )


def generator_for(
    generators: dict[torch.device, torch.Generator], device: torch.device | str, seed: int | None
) -> torch.Generator:
    """The generator for ``device`` in ``generators``, created and seeded on first use (``seed``
    None: fresh OS randomness). One stream per device, so runs reproduce from the seed alone."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in generators:
        g = torch.Generator(device=device)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed)
        generators[device] = g
    return generators[device]


def load_policy(source: str | Path | Mapping[str, Any] | PolicyConfig | Policy, **overrides: Any) -> Policy:
    """Load a policy: a registered name (``"vase-attnv"``), a YAML path, a mapping or a config.

    ``overrides`` replace schedule fields (``budget``, ``recent``, ``interval``, ``window``,
    ``count``, ``compress_prompt``) or top-level ones (``seed``, ``name``); everything is
    validated before any tensor work, with errors naming file, line and field.
    """
    if isinstance(source, Policy):
        return source.with_overrides(**overrides) if overrides else source
    if isinstance(source, PolicyConfig):
        source = source.to_dict()
    lines: dict[tuple, int] = {}
    if isinstance(source, Mapping):
        data, name = dict(source), "<mapping>"
    else:
        registry = get_registry()
        text_src = source
        if isinstance(source, str) and source in registry.policies:
            text_src = registry.policies[source].obj
            if isinstance(text_src, Mapping):
                return load_policy(text_src, **overrides)
        elif isinstance(source, str) and not Path(source).suffix and not Path(source).exists():
            known = ", ".join(sorted(registry.policies))
            raise PolicyError([f"unknown policy {source!r}; registered policies: {known}"], source)
        if isinstance(text_src, str) and "\n" in text_src:
            text, name = text_src, f"<{source}>"
        else:
            text, name = read_source(text_src)
        data, lines = read_policy_text(text, name)
    if overrides:
        if not isinstance(data, Mapping):
            return Policy(parse_policy(data, name, lines), data)
        data = apply_overrides(data, overrides)
    return Policy(parse_policy(data, name, lines), data if isinstance(data, Mapping) else None)


def _check_inputs(keys, values, queries, slot_valid, query_valid, positions) -> None:
    for label, t in (("keys", keys), ("values", values), ("queries", queries)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{label} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{label} must be float32, float16 or bfloat16, got {t.dtype}")
    b, hkv, n, d = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values {tuple(values.shape)} must match keys {tuple(keys.shape)} in [B, Hkv, N]")
    if queries.shape[0] != b or queries.shape[3] != d:
        raise ValueError(f"queries {tuple(queries.shape)} must be [B={b}, Hq, W, D={d}] for keys {tuple(keys.shape)}")
    if queries.shape[1] % hkv != 0:
        raise ValueError(
            f"query heads ({queries.shape[1]}) must be a multiple of KV heads ({hkv}): "
            f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)}"
        )
    devices = {t.device for t in (keys, values, queries)}
    checks = (
        ("slot_valid", slot_valid, [(b, n), (b, hkv, n)]),
        ("query_valid", query_valid, [(b, queries.shape[2])]),
        ("positions", positions, [(b, n), (b, hkv, n)]),
    )
    for label, t, shapes in checks:
        if t is None:
            continue
        if tuple(t.shape) not in shapes:
            raise ValueError(f"{label} must have shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
