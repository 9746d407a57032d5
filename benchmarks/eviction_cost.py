"""The cost of one eviction at vLLM's shape, per policy, beside ``snapkv``'s in the same run.

vLLM's paged store evicts the due requests of every layer at once (rows = requests x layers,
``PagedCache.gather_requests``); this times ``kvpolicy.eviction.evict`` on such an input alone,
without the engine: SmolLM2-135M's heads (3 KV heads, 9 query heads, head size 64, 30 layers),
16 requests at their first eviction (``budget + interval`` slots), random keys, values, queries
and state. Policies that read the model get the facts of a randomly initialised model of that
shape. One thread; each policy is timed in turn within every repeat (medians)::

    python benchmarks/eviction_cost.py snapkv h2o cam lagkv expected-attention [--profile]

``--profile`` prints torch's operator table of one eviction of each policy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvpolicy
from kvpolicy import eviction
from kvpolicy.inputs import eviction_input


def model_facts(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpolicy.hf import model_facts as facts_of

    config = LlamaConfig(hidden_size=576, intermediate_size=64, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=layers, vocab_size=64, max_position_embeddings=8192, rope_theta=100000.0)
    return facts_of(LlamaForCausalLM(config))


def eviction_of(name: str, args: argparse.Namespace, facts_cache: dict):
    """``name``'s policy at ``--budget`` and a call of one eviction of its vLLM-shaped input."""
    policy = kvpolicy.load_policy(name, budget=args.budget)
    s = policy.schedule
    n, rows = s.budget + s.interval, args.requests * args.layers
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(rows, 3, n, 64, generator=g) for _ in range(2))
    queries = torch.randn(rows, 9, max(s.window, 1), 64, generator=g)
    state = None
    if policy.keeps_state:
        state = policy.nest_state({k: torch.rand(rows, 3, n, generator=g) for k in policy.state_fields})
    facts = None
    if policy.needs_model:
        facts = facts_cache.setdefault("facts", model_facts(args.layers))
    inp = eviction_input(
        keys, values, queries, budget=s.budget, recent=s.recent, seed=0,
        layer_idx=torch.arange(args.layers).repeat_interleave(args.requests),
        evictions=torch.zeros(rows, dtype=torch.long), positions=torch.arange(n).expand(rows, 3, n),
        prompt_lengths=32, state=state, model=facts,
    )
    return lambda: eviction.evict(policy, inp), (rows, n, s.window)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="+")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = ["snapkv", *[p for p in args.policies if p != "snapkv"]]
    facts_cache: dict = {}
    runs = {name: eviction_of(name, args, facts_cache) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for fn, _ in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, (fn, _) in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["snapkv"])
    print("| policy | rows x slots (window) | ms per eviction | / snapkv |")
    print("| --- | --- | --- | --- |")
    for name, (_, (rows, n, w)) in runs.items():
        ms = statistics.median(times[name])
        print(f"| {name} | {rows} x {n} ({w}) | {ms * 1e3:.1f} | {ms / base:.2f}x |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, (fn, _) in runs.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"\n{name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
