"""State a stage keeps across evictions: the declaration of one field (``StateField``). The name
each field is stored under in a policy is ``kvpolicy.stages.stage.state_field_names``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

#: The dtypes a field with ``initial="position"`` may have: they hold ``-1`` (an empty slot) and
#: every position exactly (float32 up to ``2**24``, int32 up to ``2**31 - 1``, the others far beyond).
POSITION_DTYPES = (torch.int64, torch.int32, torch.float64, torch.float32)


@dataclass(frozen=True)
class StateField:
    """One field of state a stage keeps across evictions (``Stage.state_fields``).

    ``per="slot"``: one value per cached token, ``[B, Hkv, N]`` in the stage's input, carried
    with its token wherever the token's slot moves (compaction, padded rows, row reordering,
    per-head runs, select mode) and dropped with it. ``per="head"``: one value per row and KV
    head, ``[B, Hkv]`` (running statistics of a head). A new token (or a new row) starts at
    ``initial``:

    - a finite number, the same for every token (representable in ``dtype``: an integer within
      its range for an integer or bool dtype, within float range for a floating one);
    - ``"position"`` (plugin contract 4; per-slot fields only): the token's own position, the
      ``EvictionInput.positions`` value of its slot (what a field counting "since the token
      arrived" starts at, with no sentinel). An empty or padding slot (position ``-1``) holds
      ``-1``. Its ``dtype`` must hold every position exactly: ``POSITION_DTYPES`` (int64, int32,
      float64, or float32, exact up to ``2**24`` tokens); float16, bfloat16, bool, unsigned and
      narrower integer dtypes are refused, as is ``per="head"`` (a head has no position).

    Every store makes fresh values with ``initial_values`` (per slot) or ``initial_head_values``
    (per head), never from ``initial`` directly.
    """

    dtype: torch.dtype = torch.float32
    initial: float | Literal["position"] = 0.0
    per: Literal["slot", "head"] = "slot"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or self.dtype.is_complex:
            raise TypeError(f"StateField.dtype must be a real torch dtype, got {self.dtype!r}")
        if self.per not in ("slot", "head"):
            raise ValueError(f'StateField.per must be "slot" or "head", got {self.per!r}')
        if isinstance(self.initial, str):
            if self.initial != "position":
                raise ValueError(f'StateField.initial must be a finite number or "position", got {self.initial!r}')
            if self.per != "slot":
                raise ValueError(
                    'StateField(initial="position") is for per-slot fields only (a token\'s own position); '
                    'a per="head" field has no position: give it a constant initial'
                )
            if self.dtype not in POSITION_DTYPES:
                raise ValueError(
                    f'StateField(initial="position") needs a dtype that holds every position and -1 exactly '
                    f"(torch.int64, torch.int32, torch.float64 or torch.float32), got {self.dtype}"
                )
            return
        if not isinstance(self.initial, (int, float)):
            raise TypeError(
                f'StateField.initial must be a finite number or "position", got {type(self.initial).__name__} '
                f"{self.initial!r}"
            )
        if not math.isfinite(self.initial):
            raise ValueError(f"StateField.initial must be finite, got {self.initial!r}")
        held = torch.tensor(float(self.initial), dtype=torch.float64).to(self.dtype)
        exact = self.dtype.is_floating_point or float(held) == self.initial
        if not exact or not bool(torch.isfinite(held)):
            raise ValueError(f"StateField.initial {self.initial!r} is not representable in its dtype {self.dtype}")

    def initial_values(self, positions: torch.Tensor) -> torch.Tensor:
        """Fresh values for slots holding the tokens at ``positions`` (a long tensor of any
        shape, ``[..., N]``; ``-1`` for an empty or padding slot): a new tensor of that shape, in
        ``dtype``, on ``positions``' device. A constant ``initial`` fills it; ``"position"``
        copies the positions (so an empty slot holds ``-1``). Every store of state calls it (or
        ``initial_head_values``) to make fresh state: buffers, new tokens, a fresh ``select``."""
        if self.initial == "position":
            return positions.to(self.dtype, copy=True)
        return torch.full(positions.shape, self.initial, dtype=self.dtype, device=positions.device)

    def initial_head_values(self, shape: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """Fresh values of a per-head field (``[..., B, Hkv]``, a new row's): ``initial`` everywhere."""
        if self.initial == "position":
            raise ValueError('a field with initial="position" starts per slot: use initial_values(positions)')
        return torch.full(tuple(shape), self.initial, dtype=self.dtype, device=device)
