"""Feeding a causal LM through a cache, exactly as token-by-token decoding would evict.

Eviction fires after an append that leaves a layer with ``L > budget`` slots and the counted
length a multiple of ``interval``; a multi-token chunk after the prompt evicts only if it *ends*
on such a point. ``Stream.feed`` asks the cache how many tokens remain to its next eviction
(``EvictingCache.tokens_to_next_eviction``) and ends each chunk exactly there, so feeding chunk
by chunk evicts the same slots as feeding token by token (and is far faster).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from ..policy import Policy

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ..hf import KVPolicyCache

MAX_CHUNK = 256


def cache_argument(model) -> str:
    """``cache`` from transformers 5.24 on, ``past_key_values`` before (still accepted, deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def full_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class Stream:
    """One sequence decoded by ``model`` through a fresh cache: the policy's ``KVPolicyCache``, or a
    ``DynamicCache`` for the full-cache baseline (``policy=None``). Batch size 1.

    Chunks end where the cache says its next eviction falls.
    """

    def __init__(self, model, policy: Policy | None, base_attn: str = "sdpa") -> None:
        self.model = model
        self.policy = policy
        self.cache: DynamicCache | KVPolicyCache  # a KVPolicyCache exactly when policy is set
        if policy is None:
            from transformers import DynamicCache

            if model.config._attn_implementation != base_attn:
                model.set_attn_implementation(base_attn)
            self.cache = DynamicCache(config=model.config)
        else:
            from ..hf import KVPolicyCache

            self.cache = KVPolicyCache(policy, model)
        self._cache_arg = cache_argument(model)
        self.seen = 0
        self.device = next(model.parameters()).device

    def next_chunk(self, remaining: int, max_chunk: int = MAX_CHUNK) -> int:
        """The next chunk's size: never past the cache's next eviction point, nor ``max_chunk``."""
        size = min(remaining, max_chunk)
        if self.policy is not None:
            evicting = cast("KVPolicyCache", self.cache).evicting
            evicting.evict_due()  # what the chunk's first append would do; then the count is exact
            size = min(size, evicting.tokens_to_next_eviction() or size)
        return size

    def memory_bytes(self) -> int:
        if self.policy is None:
            return full_cache_bytes(self.cache)
        return int(cast("KVPolicyCache", self.cache).memory_bytes())

    def evictions(self) -> int:
        """Evictions summed over layers (0 for the full cache)."""
        if self.policy is None:
            return 0
        return sum(s.evictions for s in cast("KVPolicyCache", self.cache).stats())

    # -- feeding -----------------------------------------------------------------------------
    def _forward(self, ids: list[int] | torch.Tensor, all_logits: bool) -> torch.Tensor:
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        kwargs = {self._cache_arg: self.cache, "logits_to_keep": 0 if all_logits else 1}
        out = self.model(input_ids=x, use_cache=True, **kwargs)
        self.seen += x.shape[1]
        return out.logits[0].float()

    @torch.inference_mode()
    def feed(
        self,
        ids: list[int],
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Append ``ids`` (the first call is the prompt, one chunk; later ones in exact chunks).

        ``on_logits(offset, logits [T, V])`` receives every chunk's logits (offset into ``ids``).
        Returns the logits after the last token ``[V]``.
        """
        if not ids:
            raise ValueError("nothing to feed")
        offset, last = 0, None
        while offset < len(ids):
            size = len(ids) if self.seen == 0 else self.next_chunk(len(ids) - offset)
            logits = self._forward(ids[offset : offset + size], on_logits is not None)
            if on_logits is not None:
                on_logits(offset, logits)
            last = logits[-1]
            offset += size
        return cast(torch.Tensor, last)  # ids is not empty: the loop ran

    @torch.inference_mode()
    def generate(
        self,
        logits: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], float]:
        """Decode token by token from ``logits [V]`` (greedy when ``temperature`` is 0).

        Returns the new tokens (the stop token included) and the decode time in seconds.
        """
        tokens: list[int] = []
        start = time.perf_counter()
        for step in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            else:
                token = int(logits.argmax())
            tokens.append(token)
            if token in stop_ids or step == max_new_tokens - 1:
                break
            logits = self._forward([token], False)[-1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return tokens, time.perf_counter() - start


def stop_token_ids(tokenizer, model) -> frozenset[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return frozenset(ids)
