"""Decode-step cost of per-layer and per-head budgets against uniform ones, at the same total slots.

One run on CPU, one thread, side by side: an attention-heavy randomly initialised Llama (hidden
512, 2 layers, 8 heads of 64, MHA) is prefilled with a prompt past the budget, decodes until every
cache has evicted at least once (so a per-head cache holds uneven heads), then times decode steps
in alternating trials, each cache stepping the same tokens:

- ``snapkv`` (uniform), ``pyramidkv`` (per-layer budgets) and ``ada-snapkv`` (per-head budgets),
  all at ``--budget`` (the same total slots and KV bytes);
- the median time of a step with no eviction due (attention over the held slots and the model),
  and of a step that evicts, and the ratio of each to uniform; and the mean over every timed step
  (evicting ones at their rate, one in ``interval``).

Usage::

    python benchmarks/allocation_bench.py              # budget 512, 200 timed steps per cache
    python benchmarks/allocation_bench.py --quick      # budget 256, 130 steps (two evictions at interval 64)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode_timing import build_model, time_decode

import kvpolicy

POLICIES = ("snapkv", "pyramidkv", "ada-snapkv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per cache")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.steps = 256, 130  # past two evictions at the policies' interval of 64
    interval = max(kvpolicy.load_policy(name).schedule.interval for name in POLICIES)
    if args.steps <= interval:
        parser.error(f"--steps {args.steps} times no evicting step: the policies evict every {interval} tokens")
    torch.set_num_threads(1)
    # A prompt past every layer's budget, pyramid's first too.
    named = {name: kvpolicy.load_policy(name, budget=args.budget) for name in POLICIES}
    caches, plain, evicting = time_decode(build_model(), named, 2 * args.budget, args.steps)
    uneven = caches["ada-snapkv"].evicting.layers[0]
    held = uneven.valid.sum(-1)[0].tolist()
    print(f"budget {args.budget}, {args.steps} steps per cache, 1 thread; ada-snapkv layer 0 heads hold {held}")
    print("KV bytes: " + ", ".join(f"{n} {caches[n].memory_bytes() / 2**20:.2f} MiB" for n in POLICIES))
    base_plain = statistics.median(plain["snapkv"])
    base_evict = statistics.median(evicting["snapkv"]) if evicting["snapkv"] else float("nan")
    # Mean over every timed step: what decoding costs, evicting steps included at their rate.
    base_mean = statistics.fmean(plain["snapkv"] + evicting["snapkv"])
    print(f"{'policy':<12} {'step ms':>8} {'vs uniform':>10} {'evicting step ms':>17} {'vs uniform':>10} "
          f"{'mean step ms':>13} {'vs uniform':>10}")
    for name in POLICIES:
        p = statistics.median(plain[name])
        e = statistics.median(evicting[name]) if evicting[name] else float("nan")
        m = statistics.fmean(plain[name] + evicting[name])
        print(f"{name:<12} {p * 1e3:8.3f} {p / base_plain:9.2f}x {e * 1e3:17.3f} {e / base_evict:9.2f}x "
              f"{m * 1e3:13.3f} {m / base_mean:9.2f}x")


if __name__ == "__main__":
    main()
