"""Where a slot's key and value live in one layer's KV cache: the layout the attention backend declares.

vLLM 0.32 describes every KV cache by the same logical axes, ``[L, B, H, N, C]`` (layer, block,
KV head, slot in the block, content), and a **stride order**: the ``KVCacheLayout`` the backends
declare (``AttentionBackend.supported_kv_cache_layouts``; the engine core resolves one per server
and records it as ``cache_config.kv_cache_layout``). Each layer's cache is a strided view
``[B, H, N, C]`` of one buffer that may interleave layers (``BL...`` layouts: a block of every
layer, then the next block). What the content ``C`` holds is the backend's:

* ``cells`` (every GPU backend of vLLM 0.32: FlashAttention, FlashInfer, Triton, FlexAttention,
  ROCm): each (block, head, slot) cell holds the key then the value, ``C = D + D_v``; backends
  read them as ``kv_cache.transpose(1, 2).split(D, -1)``;
* ``cpu_pages`` (the CPU backend, ``cpu_attn``, which declares ``LBHNC`` only): each (block,
  head) page of ``N * C`` elements is read as two halves, the block's keys transposed (element
  ``d`` of slot ``o`` at ``d * N + o``, as its ``vec``/``vec16`` kernels store them) then its
  values ``[N, D]``. Packed ISA variants are caught by the worker's check of the first keys written.

``BlockLayout.split`` turns either into the one view the rest of the plugin uses: keys and values
``[num_blocks, block_size, Hkv, D]`` (views: writing them writes the cache). Nothing here imports
vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

#: vLLM 0.32's ``KVCacheLayout`` members (``vllm/v1/kv_cache_layout.py``): the physical order of the
#: logical axes ``[L, B, H, N, C]``, outermost first. The engine tests check this table against vLLM's.
STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
Interior = Literal["cells", "cpu_pages"]
#: Backends whose block interior is ``cpu_pages`` (by ``AttentionBackend.get_name()``); any other
#: backend of a full-attention layer stores ``cells``.
CPU_PAGE_BACKENDS = frozenset({"CPU_ATTN"})


class LayoutError(ValueError):
    """A cache tensor that does not have the layout it was declared with."""


@dataclass(frozen=True)
class BlockLayout:
    """One layer's block layout: ``name`` (a ``KVCacheLayout``), the block ``interior``, and the
    key head size ``head_dim`` (``D``; values have the same size)."""

    name: str
    interior: Interior
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in STRIDE_ORDERS:
            raise LayoutError(f"unknown KV cache layout {self.name!r}; known: {sorted(STRIDE_ORDERS)}")
        if self.interior == "cpu_pages" and self.name != "LBHNC":
            raise LayoutError(f"the CPU backend's pages need layout LBHNC (a block's [N, C] contiguous), not {self.name}")

    @classmethod
    def for_backend(cls, backend_name: str, layout_name: str, head_dim: int) -> BlockLayout:
        interior: Interior = "cpu_pages" if backend_name in CPU_PAGE_BACKENDS else "cells"
        return cls(layout_name, interior, head_dim)

    def split(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_blocks, block_size, Hkv, D]`` (views) of one layer's cache
        ``[num_blocks, Hkv, block_size, C]`` (the layer's logical view, any strides)."""
        if layer_cache.dim() != 4:
            raise LayoutError(f"a layer's KV cache is [blocks, kv_heads, block_size, content], got {tuple(layer_cache.shape)}")
        nb, h, bs, c = layer_cache.shape
        d = self.head_dim
        if c != 2 * d:
            raise LayoutError(f"cache content {c} is not key + value of head size {d} (different value sizes are not supported)")
        if self.interior == "cells":
            kv = layer_cache.transpose(1, 2)  # [B, N, H, C]
            return kv[..., :d], kv[..., d:]
        if layer_cache.stride(3) != 1 or layer_cache.stride(2) != c:
            raise LayoutError(f"the CPU backend's pages need each block's [N, C] contiguous; strides {layer_cache.stride()}")
        pages = layer_cache.view(nb, h, 2, bs * d)
        keys = pages[:, :, 0].view(nb, h, d, bs).permute(0, 3, 1, 2)
        values = pages[:, :, 1].view(nb, h, bs, d).transpose(1, 2)
        return keys, values


def layer_views(buffer: torch.Tensor, layout: str, num_layers: int, num_blocks: int, kv_heads: int,
                block_size: int, content: int) -> list[torch.Tensor]:
    """Per-layer caches ``[num_blocks, Hkv, block_size, content]`` over one flat ``buffer`` laid out
    in ``layout``, as vLLM 0.32 allocates them (dense, no padding): the innermost physical axis
    has stride 1 and each axis outward strides over all the axes inside it."""
    sizes = (num_layers, num_blocks, kv_heads, block_size, content)
    strides = [0] * 5
    step = 1
    for axis in reversed(STRIDE_ORDERS[layout]):
        strides[axis] = step
        step *= sizes[axis]
    if buffer.numel() < step:
        raise LayoutError(f"buffer of {buffer.numel()} elements; layout needs {step}")
    full = buffer.as_strided(sizes, strides, buffer.storage_offset())
    return list(full.unbind(0))
