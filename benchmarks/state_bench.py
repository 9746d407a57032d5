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

import torch
from decode_timing import build_model, time_decode

import kvpolicy

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps per cache")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.steps = 256, 96
    torch.set_num_threads(1)
    named = policies(args.budget)
    caches, plain, evicting = time_decode(build_model(), named, 2 * args.budget, args.steps)
    print(f"budget {args.budget}, {args.steps} steps per cache, 1 thread")
    base_plain = statistics.median(plain[BASE])
    base_evict = statistics.median(evicting[BASE]) if evicting[BASE] else float("nan")
    base_mean = statistics.fmean(plain[BASE] + evicting[BASE])
    base_bytes = caches[BASE].memory_bytes()
    print(f"{'policy':<14} {'step ms':>8} {'ratio':>7} {'evicting ms':>12} {'ratio':>7} {'mean ms':>8} {'ratio':>7} "
          f"{'memory MiB':>11} {'ratio':>7}")
    for name in named:
        p = statistics.median(plain[name])
        e = statistics.median(evicting[name]) if evicting[name] else float("nan")
        m = statistics.fmean(plain[name] + evicting[name])
        b = caches[name].memory_bytes()
        print(f"{name:<14} {p * 1e3:8.3f} {p / base_plain:6.3f}x {e * 1e3:12.3f} {e / base_evict:6.3f}x "
              f"{m * 1e3:8.3f} {m / base_mean:6.3f}x {b / 2**20:11.3f} {b / base_bytes:6.3f}x")


if __name__ == "__main__":
    main()
