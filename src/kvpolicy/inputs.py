"""What a policy sees at one eviction: ``eviction_input`` assembles the ``EvictionInput`` of
``Policy.select`` and of every engine (the caches' executor, vLLM's paged cache), and
``check_tensors`` refuses the tensors of a one-shot call before any work."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch

from . import seeds
from .stages.base import EvictionInput
from .stages.model_facts import ModelFacts

#: The dtypes ``Policy.select`` and the caches serve: anything else is refused by name.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def eviction_input(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    *,
    budget: int,
    recent: int,
    seed: int,
    slot_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    layer_idx: int | torch.Tensor = 0,
    evictions: int | torch.Tensor = 0,
    streams: int | torch.Tensor = 0,
    key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    head_offset: int = 0,
    query_positions: torch.Tensor | None = None,
    query_new: torch.Tensor | None = None,
    state: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    model: ModelFacts | None = None,
    prompt_lengths: int | torch.Tensor | None = None,
) -> EvictionInput:
    """Assemble the ``EvictionInput`` of one eviction: the one place that does, for
    ``Policy.select`` and the executor alike.

    Fills the defaults ``Policy.select`` documents (all slots and queries valid, positions
    ``0 .. N-1``, ``[B, N]`` masks broadcast over heads) and derives each row's seeds from
    ``seed``, ``layer_idx``, ``evictions`` and ``streams`` (ints, or ``[B]`` tensors). Inputs are not checked
    here: ``Policy.select`` checks them first. ``query_positions`` and ``query_new`` default as
    ``EvictionInput`` fills them. ``prompt_lengths``: each row's prompt tokens (an int or ``[B]``;
    None: not known), refused if negative.
    """
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
    if not 0 <= seed <= seeds.INT64_MAX:
        raise ValueError(f"seed must lie in [0, 2**63 - 1], got {seed}")
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or not 0 <= head_offset <= MAX_HEAD_OFFSET:
        raise ValueError(f"head_offset must be an int in [0, {MAX_HEAD_OFFSET}], got {head_offset!r}")
    prompts = None
    if prompt_lengths is not None:
        prompts = _per_row(prompt_lengths, b, "prompt_lengths")
        if bool((prompts < 0).any()):
            raise ValueError(f"prompt_lengths must be >= 0, got {prompts.tolist()}")
        prompts = prompts.to(device)
    key = seeds.SeedKey(
        seed, _per_row(layer_idx, b, "layer_idx"), _per_row(streams, b, "streams"), _per_row(evictions, b, "evictions")
    )
    return EvictionInput(
        keys=keys,
        values=values,
        queries=queries,
        budget=min(n, budget),
        num_candidates=max(0, n - recent),
        slot_valid=slot_valid,
        query_valid=query_valid,
        positions=positions,
        seed_key=key,
        key_pages=key_pages,
        head_offset=head_offset,
        # None: EvictionInput fills the defaults (the window's latest tokens, every valid entry new)
        query_positions=query_positions,  # type: ignore[arg-type]
        query_new=query_new,  # type: ignore[arg-type]
        state=state,
        model=model,
        prompt_lengths=prompts,
    )


#: Far above any model's KV-head count: a larger offset can only be a caller's mistake.
MAX_HEAD_OFFSET = 1 << 20


def _per_row(value: int | torch.Tensor, rows: int, label: str) -> torch.Tensor:
    """``[rows]`` int64 on the CPU from an int or a ``[rows]`` integer tensor (seeds are derived
    there). Anything else (a float, which would be truncated, a bool, a list, None) is refused."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{label} must be an int or a [B={rows}] integer tensor, got a {value.dtype} tensor")
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{label} must be an int or a [B={rows}] integer tensor, got {type(value).__name__} {value!r:.40}")
    t = torch.as_tensor(value, dtype=torch.long).cpu()
    if t.dim() == 0:
        return t.expand(rows).clone()
    if tuple(t.shape) != (rows,):
        raise ValueError(f"{label} must be an int or a [B={rows}] tensor, got shape {tuple(t.shape)}")
    return t


def unread_values(keys: torch.Tensor) -> torch.Tensor:
    """The values an engine passes where no stage of the policy reads them (``Policy.reads_values``):
    their shape and dtype (those of ``keys``) on the ``meta`` device, with no data to gather."""
    return torch.empty(keys.shape, dtype=keys.dtype, device="meta")


def check_tensors(keys, values, queries, slot_valid, query_valid, positions) -> None:
    for label, t in (("keys", keys), ("values", values), ("queries", queries)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{label} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{label} must be float32, float16, bfloat16 or float64, got {t.dtype}")
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
    devices = {keys.device, queries.device}
    if not values.is_meta:  # meta values: a placeholder where no stage reads them (Policy.reads_values)
        devices.add(values.device)
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


def check_recent_padding(slot_valid: torch.Tensor | None, recent: int) -> None:
    """The recent buffer is the last ``recent`` columns: refuse padding there that follows a real
    slot (a row packed from slot 0 that holds fewer slots, as a cache's state is). Its newest
    tokens would then compete as candidates while its padding stood in for them."""
    if slot_valid is None or recent < 1:
        return
    tail = min(recent, slot_valid.shape[-1])
    after_real = (slot_valid.cumsum(-1) > 0)[..., -tail:] & ~slot_valid[..., -tail:]
    if bool(after_real.any()):
        row = int(after_real.nonzero()[0, 0])
        raise ValueError(
            f"slot_valid: row {row} has padding after a real slot among the last {tail} columns, the recent buffer: "
            "pad rows on the left (their newest tokens last), or select each row on its own slots"
        )
