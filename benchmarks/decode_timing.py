"""What the decode-step benchmarks share: an attention-heavy random Llama, caches prefilled and
decoded until each has evicted, and decode steps timed in alternating trials (each cache sees
the same machine noise), split by whether an eviction was due."""

from __future__ import annotations

import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """Hidden 512, 2 layers, 8 heads of 64 (MHA): attention is a large share of a step."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, vocab_size=1024, max_position_embeddings=32768, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def time_decode(
    model: LlamaForCausalLM, policies: dict[str, kvpolicy.Policy], prompt_len: int, steps: int, warmup: int = 2 * 64 + 1,
) -> tuple[dict[str, KVPolicyCache], dict[str, list[float]], dict[str, list[float]]]:
    """Prefill each policy's cache with the same ``prompt_len`` tokens, decode ``warmup`` steps
    (every cache must have evicted by then), then time ``steps`` decode steps per cache in
    alternating trials. Returns the caches and the seconds of the steps with no eviction due and
    of the evicting ones, by policy name."""
    prompt = torch.randint(0, 1024, (1, prompt_len))
    caches, nexts = {}, {}
    with torch.no_grad():
        for name, policy in policies.items():
            cache = KVPolicyCache(policy, model)
            out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
            nexts[name] = out.logits[:, -1:].argmax(-1)
            caches[name] = cache
        for _ in range(warmup):
            for name in policies:
                out = model(input_ids=nexts[name], past_key_values=caches[name], use_cache=True)
                nexts[name] = out.logits[:, -1:].argmax(-1)
        assert all(min(s.evictions for s in caches[n].stats()) > 0 for n in policies), "a cache never evicted"
        plain: dict[str, list[float]] = {n: [] for n in policies}
        evicting: dict[str, list[float]] = {n: [] for n in policies}
        for _ in range(steps):
            for name in policies:
                cache = caches[name]
                due = any(layer.eviction_due for layer in cache.evicting.layers)
                t0 = time.perf_counter()
                out = model(input_ids=nexts[name], past_key_values=cache, use_cache=True)
                elapsed = time.perf_counter() - t0
                nexts[name] = out.logits[:, -1:].argmax(-1)
                (evicting if due else plain)[name].append(elapsed)
    return caches, plain, evicting
