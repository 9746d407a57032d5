"""Counter-based randomness: every random number a stage draws is a pure function of seeds.

Why not ``torch.Generator``: a generator's stream is laid out over the whole batch, so a row's
draws depend on which other rows share the batch, on the order of evictions, and on the device.
Here each batch row of each layer draws from its own stream, keyed by

- the **layer seed** ``mix(policy seed, layer index)``: fixed for a layer over a whole run
  (CurDKV's fixed projection), and
- the **row seed** ``mix(layer seed, stream, evictions the row has had)``: fresh at every
  eviction (VaSE's resampled projection and sampling). The stream is 0 by default, so a row's
  draws depend on nothing but the row's own history: identical rows at the same eviction draw
  the same numbers. Caches built with ``independent_rows=True`` give row ``r`` stream ``r``
  instead (independent samples of one prompt, at the price of batch invariance),

and element ``i`` of a draw is ``splitmix64(row seed, stream, i)``. So a padded row draws exactly
what it draws alone, a reset cache what a fresh one draws, ``Policy.select`` what the cache drew,
and, being integer arithmetic on the seeds
alone, the draws do not depend on a device's generator (the same bits on CPU and GPU are
expected but were only checked on CPU). All arithmetic is on int64 tensors, wrapping like uint64
(two's complement); right shifts are masked to make them logical.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import cached_property

import torch

# splitmix64's constants, as signed int64.
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
INT64_MAX = (1 << 63) - 1


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of ``x + gamma``: a bijection of int64 that scrambles every bit."""
    z = x + _GAMMA
    z = (z ^ _srl(z, 30)) * _MUL1
    z = (z ^ _srl(z, 27)) * _MUL2
    return z ^ _srl(z, 31)


def combine(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    """A seed derived from two: ``mix(mix(a) ^ b)`` (order matters)."""
    return mix(mix(a) ^ b)


def stream_id(name: str) -> int:
    """A stable int for a stream name (``"stochastic"``, ``"leverage"``): CRC-32 of its UTF-8."""
    return zlib.crc32(name.encode("utf-8"))


def layer_seeds(seed: int, layer_idx: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: the fixed seed of each stacked row's layer."""
    if not 0 <= seed <= INT64_MAX:
        raise ValueError(f"seed must lie in [0, 2**63 - 1], got {seed}")
    return combine(torch.full_like(layer_idx, seed, dtype=torch.long), layer_idx.long())


def row_seeds(layer_seed: torch.Tensor, streams: torch.Tensor, evictions: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: the seed of each row's current eviction in its stream."""
    return combine(combine(layer_seed, streams.long()), evictions.long())


def uniform(
    seeds: torch.Tensor, shape: tuple[int, ...], stream: str, device: torch.device | None = None, start: int = 0
) -> torch.Tensor:
    """``[R, *shape]`` float32 in the open interval ``(0, 1)``, one independent stream per seed.

    Element ``i`` (row-major over ``shape``) of row ``r`` is a function of ``seeds[r]``,
    ``stream`` and ``start + i`` only: it does not depend on the other rows or on ``device``.
    ``start`` reads a window of a longer draw: the draw of shape ``(n, *rest)`` with ``start =
    a * prod(rest)`` equals entries ``a .. a+n-1`` of the draw of shape ``(a + n, *rest)`` (how a
    tensor-parallel rank draws for its own slice of the heads).
    """
    device = seeds.device if device is None else device
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    count = math.prod(shape)
    base = combine(seeds.to(device), stream_id(stream))  # [R]
    counter = (torch.arange(count, device=device, dtype=torch.long) + start) * _GAMMA
    bits = mix(base[:, None] + counter)  # [R, count]
    # The top 24 bits, centred in their bucket: exactly representable in float32, never 0 or 1.
    u = (_srl(bits, 40).float() + 0.5) * (1.0 / (1 << 24))
    return u.view(seeds.shape[0], *shape)


def normal(
    seeds: torch.Tensor, shape: tuple[int, ...], stream: str, device: torch.device | None = None, start: int = 0
) -> torch.Tensor:
    """``[R, *shape]`` float32 standard normal draws (Box-Muller on two uniform streams; ``start``
    as in ``uniform``)."""
    u1 = uniform(seeds, shape, stream + "/radius", device, start)
    u2 = uniform(seeds, shape, stream + "/angle", device, start)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)


@dataclass(frozen=True)
class SeedKey:
    """What keys one eviction's random streams, per stacked row: the policy's seed, each row's
    layer, stream and eviction count (``[R]`` long host tensors). The seeds themselves are derived
    on first use, so a deterministic policy never pays for them."""

    seed: int
    layer_idx: torch.Tensor
    streams: torch.Tensor
    evictions: torch.Tensor

    @cached_property
    def layer(self) -> torch.Tensor:
        """``[R]`` int64: the fixed seed of each row's layer."""
        return layer_seeds(self.seed, self.layer_idx)

    @cached_property
    def row(self) -> torch.Tensor:
        """``[R]`` int64: the seed of each row's current eviction in its stream."""
        return row_seeds(self.layer, self.streams, self.evictions)

    @classmethod
    def zeros(cls, rows: int) -> SeedKey:
        zero = torch.zeros(rows, dtype=torch.long)
        return cls(0, zero, zero, zero)
