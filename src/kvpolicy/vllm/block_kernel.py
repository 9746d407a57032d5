"""Select mode's chosen blocks attended by vLLM's CPU attention kernel, read in place.

A page choice (Quest at block pages) attends whole blocks. The CPU backend's kernel
(``cpu_attention_with_kv_cache``) attends, per sequence, the first ``seq_len`` slots of the
blocks its block-table row lists, so it can read just the chosen blocks: no gather, and no
attention over every slot first. But its block table is per sequence, and a page choice's KV
heads choose different blocks. So each (request, KV head) becomes a sequence of its own with one
KV head: the layer's cache ``[num_blocks, Hkv, 2 * block_size, D]`` (keys, then values, of one
block and head in one contiguous unit, whatever the kernel packs inside it) is viewed as
``[num_blocks * Hkv, 1, 2 * block_size, D]``, block ``b`` of head ``g`` is block ``b * Hkv + g``
there, and the sequence's queries are that KV head's query heads.

The worker hands it to ``BlockSelection.attend`` (``kvpolicy.vllm.select.BlockAttention``) on a
server whose layers run the CPU backend; the engine tests check it against the gathering path.
"""

from __future__ import annotations

from typing import Any

import torch

from . import contract
from .support import KVPolicyInvariantError

#: What the kernel call reads on the CPU backend's ``AttentionImpl`` and its ``Attention`` layer.
CPU_IMPL = contract.Contract("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl", {
    "kv_cache_dtype": "the kernel's cache dtype", "logits_soft_cap": "the kernel's soft cap (refused if set)",
})
CPU_LAYER = contract.Contract("vllm.model_executor.layers.attention.attention.Attention", {
    "isa": "the kernel's instruction set, set by the CPU metadata builder",
    "_k_scale_float": "the kernel's key scale", "_v_scale_float": "the kernel's value scale",
})
CPU_OPS = contract.Contract("vllm._custom_ops", {
    "cpu_attention_with_kv_cache": "the kernel that reads the chosen blocks",
    "cpu_attn_get_scheduler_metadata": "its work split over the sequences",
})


def runs_cpu_kernel(impl: Any) -> bool:
    """Whether ``impl`` is the CPU backend's attention (the kernel this module calls)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return isinstance(impl, CPUAttentionBackendImpl)


def kernel_for(impl: Any, layer: Any, kv_cache: torch.Tensor) -> CpuBlocks | None:
    """The CPU kernel over ``layer``'s cache where ``impl`` is the CPU backend's, else None (the
    caller gathers and attends itself)."""
    return CpuBlocks(impl, layer, kv_cache) if runs_cpu_kernel(impl) else None


def check(impl: Any, layer: Any) -> None:
    """Refuse, by name, a vLLM whose CPU kernel or attention objects lack what the call reads."""
    from vllm import _custom_ops

    contract.check_once(impl, CPU_IMPL)
    contract.check_once(layer, CPU_LAYER)
    contract.check_once(_custom_ops, CPU_OPS)


class CpuBlocks:
    """``BlockAttention`` by the CPU kernel over one layer's cache (``kv_cache`` as the backend's
    ``forward`` gets it), with the attention options of its ``impl`` and ``layer``."""

    def __init__(self, impl: Any, layer: Any, kv_cache: torch.Tensor) -> None:
        self.impl, self.layer, self.kv_cache = impl, layer, kv_cache

    def __call__(self, query: torch.Tensor, blocks: torch.Tensor, length: int | torch.Tensor, scale: float) -> torch.Tensor:
        """``query [R, Hq, D]``, ``blocks [R, Hkv, m]`` (each KV head's block ids, in attention
        order), the first ``length`` slots of them attended (one count, or each KV head's ``[R,
        Hkv]``) -> ``[R, Hq, D]``."""
        from vllm import _custom_ops as ops

        impl, layer = self.impl, self.layer
        if impl.logits_soft_cap or impl.alibi_slopes is not None or impl.sinks is not None:
            raise KVPolicyInvariantError("select mode's kernel call got a layer with soft-capping, ALiBi or sinks, "
                                         "which the worker refuses at start-up")
        r, kv_heads, m = blocks.shape
        num_blocks, _, block_size, width = self.kv_cache.shape
        lengths = torch.as_tensor(length, dtype=torch.int32).expand(r, kv_heads).flatten()
        if int(lengths.max()) > m * block_size or int(lengths.min()) < 1:
            raise KVPolicyInvariantError(f"{length} slots attended over {m} blocks of {block_size}")
        head_dim = width // 2
        per_kv = query.shape[1] // kv_heads
        cache = self.kv_cache.view(num_blocks * kv_heads, 1, 2 * block_size, head_dim)
        key_cache, value_cache = cache.chunk(2, dim=2)
        heads = torch.arange(kv_heads, device=blocks.device)[None, :, None]
        table = (blocks * kv_heads + heads).view(r * kv_heads, m).to(torch.int32)
        sequences = r * kv_heads
        seq_lens = lengths.contiguous()
        starts = torch.arange(sequences + 1, dtype=torch.int32)  # one query per sequence
        q = query.reshape(sequences, per_kv, head_dim).to(cache.dtype).contiguous()
        dtype = impl.kv_cache_dtype
        work = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=sequences, num_heads=per_kv, num_kv_heads=1, head_dim=head_dim, seq_lens=seq_lens,
            dtype=cache.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=layer.isa,
            enable_kv_split=False, kv_cache_dtype=dtype)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=work, s_aux=None, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=dtype)
        return out.view(r, kv_heads * per_kv, head_dim)
