"""Decode-step cost and memory of a policy that keeps state, against the same policy without it.

One run on CPU, one thread, side by side, each cache stepping the same tokens in alternating
trials, on an attention-heavy randomly initialised Llama (hidden 512, 2 layers, 8 heads of 64):

- ``h2o``: H2O's accumulated attention (a float32 per held slot and KV head, updated at each
  eviction and before unseen queries leave the window);
- ``h2o-windowed``: the same policy without state: the same scorer arithmetic over the window
  only (``attention`` with ``softmax_over: all``, the window summed, no pooling), the same
  schedule, so the difference is the state alone;
- ``h2o-w16``: ``h2o`` with a window of 16 under an interval of 64, so the state is also brought
  up to date between evictions (every 16 steps).

Prints the median step with no eviction due, the median evicting step, the mean over every step,
each as a ratio to ``h2o-windowed``, and ``memory_bytes()`` (the state counted).

Usage::

    python benchmarks/state_bench.py              # budget 512, 256 timed steps per cache
    python benchmarks/state_bench.py --quick      # budget 256, 96 steps
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402

BASE = "h2o-windowed"


def policies(budget: int) -> dict[str, kvpolicy.Policy]:
    schedule = {"budget": budget, "recent": 64, "interval": 64, "window": 64}
    windowed = {"name": BASE, "schedule": schedule, "selector": "greedy",
                "scorer": {"type": "attention", "softmax_over": "all", "window_reduce": "sum", "pooling": "none"}}
    return {
        BASE: kvpolicy.load_policy(windowed),
        "h2o": kvpolicy.load_policy("h2o", **schedule),
        "h2o-w16": kvpolicy.load_policy("h2o", **{**schedule, "window": 16}),
    }


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, vocab_size=1024, max_position_embeddings=32768, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps per cache")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.steps = 256, 96
    torch.set_num_threads(1)
    model = build_model()
    prompt = torch.randint(0, 1024, (1, 2 * args.budget))
    named = policies(args.budget)
    caches, nexts = {}, {}
    with torch.no_grad():
        for name, policy in named.items():
            cache = KVPolicyCache(policy, model)
            out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
            nexts[name] = out.logits[:, -1:].argmax(-1)
            caches[name] = cache
        for _ in range(2 * 64 + 1):  # until every cache has evicted
            for name in named:
                out = model(input_ids=nexts[name], past_key_values=caches[name], use_cache=True)
                nexts[name] = out.logits[:, -1:].argmax(-1)
        assert all(min(s.evictions for s in caches[n].stats()) > 0 for n in named)
        plain: dict[str, list[float]] = {n: [] for n in named}
        evicting: dict[str, list[float]] = {n: [] for n in named}
        for _ in range(args.steps):
            for name in named:  # alternating: each cache sees the same machine noise
                cache = caches[name]
                due = any(layer.eviction_due for layer in cache.evicting.layers)
                t0 = time.perf_counter()
                out = model(input_ids=nexts[name], past_key_values=cache, use_cache=True)
                elapsed = time.perf_counter() - t0
                nexts[name] = out.logits[:, -1:].argmax(-1)
                (evicting if due else plain)[name].append(elapsed)
    print(f"budget {args.budget}, {args.steps} steps per cache, 1 thread")
    base_plain = statistics.median(plain[BASE])
    base_evict = statistics.median(evicting[BASE])
    base_mean = statistics.fmean(plain[BASE] + evicting[BASE])
    base_bytes = caches[BASE].memory_bytes()
    print(f"{'policy':<14} {'step ms':>8} {'ratio':>7} {'evicting ms':>12} {'ratio':>7} {'mean ms':>8} {'ratio':>7} "
          f"{'memory MiB':>11} {'ratio':>7}")
    for name in named:
        p = statistics.median(plain[name])
        e = statistics.median(evicting[name])
        m = statistics.fmean(plain[name] + evicting[name])
        b = caches[name].memory_bytes()
        print(f"{name:<14} {p * 1e3:8.3f} {p / base_plain:6.3f}x {e * 1e3:12.3f} {e / base_evict:6.3f}x "
              f"{m * 1e3:8.3f} {m / base_mean:6.3f}x {b / 2**20:11.3f} {b / base_bytes:6.3f}x")


if __name__ == "__main__":
    main()
