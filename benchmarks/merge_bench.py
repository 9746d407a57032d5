"""Decode-step cost of a merge: ``snapkv`` with and without a merge stage, side by side.

One run on CPU, one thread, each cache stepping the same tokens in alternating trials, on the
attention-heavy randomly initialised Llama of ``decode_timing`` (hidden 512, 2 layers, 8 heads of
64). The policies differ in their ``merge`` only:

- ``snapkv``: the built-in, evicted tokens dropped (``merge: drop``);
- ``snapkv-merge``: the built-in with kvpress MergingPress's rule (``merge: similar``);
- ``snapkv+cam``: CaM's merge (``merge: cam``; it keeps accumulated attention as state);
- ``snapkv+d2o``: D2O's merge (``merge: d2o``; per-slot merge weights as state).

Prints, per policy, the mean step with no eviction due, the mean evicting step and the mean over
every step, each as a ratio to ``snapkv`` (the target: a mean step within 1.10x), and
``memory_bytes()``.

Usage::

    python benchmarks/merge_bench.py              # budget 512, 256 timed steps per cache
    python benchmarks/merge_bench.py --quick      # budget 256, 128 steps
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode_timing import build_model, time_decode

import kvpolicy

BASE = "snapkv"


def policies(budget: int) -> dict[str, kvpolicy.Policy]:
    schedule = {"budget": budget, "recent": 64, "interval": 64, "window": 64}
    base = kvpolicy.load_policy(BASE, **schedule)
    with_merge = {name: {**base.config.to_dict(), "name": name, "merge": merge} for name, merge in (
        ("snapkv+cam", {"type": "cam"}), ("snapkv+d2o", {"type": "d2o"}))}
    return {
        BASE: base,
        "snapkv-merge": kvpolicy.load_policy("snapkv-merge", **schedule),
        **{name: kvpolicy.load_policy(data) for name, data in with_merge.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps per cache")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.steps = 256, 128
    torch.set_num_threads(1)
    named = policies(args.budget)
    caches, plain, evicting = time_decode(build_model(), named, 2 * args.budget, args.steps)
    print(f"budget {args.budget}, {args.steps} steps per cache, 1 thread")
    base_plain, base_evict = statistics.fmean(plain[BASE]), statistics.fmean(evicting[BASE])
    base_mean = statistics.fmean(plain[BASE] + evicting[BASE])
    base_bytes = caches[BASE].memory_bytes()
    print(f"{'policy':<14} {'decode ms':>9} {'ratio':>7} {'evicting ms':>12} {'ratio':>7} {'mean ms':>8} {'ratio':>7} "
          f"{'memory MiB':>11} {'ratio':>7}")
    for name in named:
        p, e = statistics.fmean(plain[name]), statistics.fmean(evicting[name])
        m = statistics.fmean(plain[name] + evicting[name])
        b = caches[name].memory_bytes()
        print(f"{name:<14} {p * 1e3:9.3f} {p / base_plain:6.3f}x {e * 1e3:12.3f} {e / base_evict:6.3f}x "
              f"{m * 1e3:8.3f} {m / base_mean:6.3f}x {b / 2**20:11.3f} {b / base_bytes:6.3f}x")


if __name__ == "__main__":
    main()
