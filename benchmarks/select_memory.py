"""Select mode's memory against the full cache: ``memory_bytes()`` of ``KVPolicyCache`` in select
mode next to the bytes of transformers' ``DynamicCache`` holding the same tokens.

Two parts, both on the bundled model (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32):

- **the model**: prompts of 512, 2,048 and 8,192 tokens prefilled through the model with each
  cache, then 16 tokens decoded; the bytes each cache holds then;
- **every length**: the same cache shapes fed keys directly (no model, so it takes seconds): a
  prompt of 64 tokens, then decoding one token at a time to 8,192, tracking the largest ratio
  to the full cache's bytes at each length from 512 on (just after each growth is the worst).

Usage::

    python benchmarks/select_memory.py                   # both parts (a few minutes on 2 cores)
    python benchmarks/select_memory.py --no-model        # the shape-only part
    python benchmarks/select_memory.py --lengths 512 2048 --growth 1.25
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kvpolicy  # noqa: E402
from kvpolicy import EvictingCache  # noqa: E402
from kvpolicy.state import SELECT_GROWTH  # noqa: E402

POLICIES = ("oracle-topk", "quest", "vase-attnv@select")
MIB = 2**20


def dynamic_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None
    )


def model_part(lengths: list[int], budget: int, growth: float, decode: int) -> None:
    from transformers import DynamicCache

    from kvpolicy.eval.models import load_model, resolve_model
    from kvpolicy.hf import KVPolicyCache

    t0 = time.perf_counter()
    model = load_model(resolve_model("bundled"))
    print(f"bundled model loaded in {time.perf_counter() - t0:.0f}s", flush=True)
    vocab = model.config.vocab_size
    rows = []
    for n in lengths:
        prompt = torch.randint(3, vocab, (1, n - decode), generator=torch.Generator().manual_seed(n))
        measured = {}
        for name in ("full", *POLICIES):
            if name == "full":
                model.set_attn_implementation("sdpa")
                cache = DynamicCache(config=model.config)
            else:
                cache = KVPolicyCache(kvpolicy.load_policy(name, budget=budget), model, select_growth=growth)
            with torch.no_grad():
                out = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                for _ in range(decode):
                    token = out.logits[:, -1:].argmax(-1)
                    out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            measured[name] = dynamic_bytes(cache) if name == "full" else cache.memory_bytes()
            del cache
        rows.append((n, measured))
        print(f"{n} tokens done", flush=True)
    model.set_attn_implementation("sdpa")
    print(f"\nbundled model (SmolLM2-135M, float32), {decode} tokens decoded after the prompt, budget {budget}, "
          f"select_growth {growth}: MiB held (ratio to the full cache)")
    print("tokens".ljust(8) + "full".rjust(10) + "".join(p.rjust(24) for p in POLICIES))
    for n, m in rows:
        cells = "".join(f"{m[p] / MIB:>14.2f} ({m[p] / m['full']:.3f}x)" for p in POLICIES)
        print(f"{n:<8}{m['full'] / MIB:>10.2f}{cells}")


def shapes_part(budget: int, growth: float, longest: int, from_tokens: int) -> None:
    """The bundled model's cache shapes fed random keys, one token at a time: the largest ratio
    of ``memory_bytes()`` to the full cache's bytes at any length from ``from_tokens`` on."""
    layers, kv_heads, q_heads, d = 30, 3, 9, 64
    g = torch.Generator().manual_seed(0)
    print(f"\nevery length from {from_tokens} to {longest} tokens (bundled model's shapes, float32, budget {budget}, "
          f"select_growth {growth}): largest ratio to the full cache, and the buffer growths")
    for name in POLICIES:
        cache = EvictingCache(kvpolicy.load_policy(name, budget=budget), layers, select_growth=growth)
        worst = worst_kv = 0.0
        growths = capacity = 0
        n = 0
        while n < longest:
            t = 64 if n == 0 else 1
            k = torch.randn(1, kv_heads, t, d, generator=g)
            q = torch.randn(1, q_heads, t, d, generator=g)
            for layer in range(layers):
                # Append only: memory does not depend on what is chosen, and choosing at every
                # step of 30 layers up to 8K tokens would take minutes.
                cache._append(layer, k, k, q, None)
            n += t
            group = cache.layers[0].group
            _ = group.select.selection  # what the first choice allocates (counted from then on)
            if group.buffers.capacity != capacity:
                growths, capacity = growths + 1, group.buffers.capacity
            if n >= from_tokens:
                full = layers * kv_heads * n * d * 4 * 2
                held = cache.memory_bytes()
                worst = max(worst, held / full)
                worst_kv = max(worst_kv, (held - group.ring.nbytes()) / full)
        window = cache.layers[0].group.ring.nbytes() / MIB
        print(f"  {name:<20} worst {worst:.3f}x ({worst_kv:.3f}x without the policy's query window of "
              f"{window:.2f} MiB)   {growths} allocations up to {longest} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--growth", type=float, default=SELECT_GROWTH, help="select_growth of the caches")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after each prompt")
    ap.add_argument("--no-model", action="store_true", help="only the shape-only part")
    ap.add_argument("--no-shapes", action="store_true", help="only the model part")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.no_model:
        model_part(args.lengths, args.budget, args.growth, args.decode)
    if not args.no_shapes:
        shapes_part(args.budget, args.growth, max(args.lengths), min(args.lengths))


if __name__ == "__main__":
    main()
