"""Decode speed and KV memory versus generated length, full cache against every built-in policy.

One run on CPU, side by side: a tiny randomly initialised Qwen3 (hidden 256, 4 layers, 8 heads,
2 KV heads, vocab 4096, float32) decodes greedily with transformers' ``DynamicCache`` (full cache)
and with ``KVPolicyCache`` for each built-in policy at the same budget (eviction, and selection:
``oracle-topk``, ``quest`` and ``vase-attnv@select`` keep every token and attend ``budget`` slots per
step, so they pay for scoring the whole cache at every step). Reported:

- tokens/s over each segment of generated length (so the cost at long lengths is visible),
- KV bytes held at each checkpoint (full: every key/value; policy: static buffers + query windows),
- policy cost: the share of decode time spent in due evictions or in selections (select mode: the
  policy's stages at every step), timed through the executor's timing hook (``Executor.timer``;
  "calls" counts due evictions and per-layer selections),
- the slowdown of each policy against ``streamingllm`` (no scoring) at the same budget,
- the decode step's own overhead: the median time of a step with no eviction due, against the
  same step with transformers' ``StaticCache`` of the policy's capacity (``budget + interval``
  slots), measured in alternating trials (``--overhead-only`` prints just this table).

Usage::

    python benchmarks/decode_bench.py            # up to 4096 generated tokens (several minutes)
    python benchmarks/decode_bench.py --quick    # up to 1024 tokens, fewer checkpoints

The loop calls the model's forward directly (no ``generate()`` bookkeeping) so that the timings
are the model plus the cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.eval.cost import PolicyTimer, cache_bytes, time_policy  # noqa: E402
from kvpolicy.files import check_output  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402


def build_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=16384,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).eval()


def run(model, cache, prompt: torch.Tensor, checkpoints: list[int]) -> dict:
    """Greedy decoding to ``checkpoints[-1]`` tokens; per-segment tokens/s and bytes."""
    seg_rate, seg_bytes = {}, {}
    with torch.no_grad(), time_policy(cache, PolicyTimer()) as timer:
        out = model(input_ids=prompt, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        generated, start, prev = 1, time.perf_counter(), 1
        total_start = start
        for target in checkpoints:
            while generated < target:
                out = model(input_ids=token, cache=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                generated += 1
            now = time.perf_counter()
            seg_rate[target] = (generated - prev) * prompt.shape[0] / (now - start)
            seg_bytes[target] = cache_bytes(cache)
            start, prev = now, generated
        total = time.perf_counter() - total_start
    return {
        "rate": seg_rate, "bytes": seg_bytes, "total_s": total,
        "evict_s": timer.total, "evict_calls": sum(timer.calls.values()),
    }


def step_overhead(model, policies: list[str], budget: int, trials: int, batch: int) -> dict[str, tuple]:
    """Median seconds of a decode step with no eviction due, per policy, and of the same step with
    a ``StaticCache`` of the policy's capacity; trials alternate between the two so that machine
    noise hits both alike. Returns ``{policy: (policy_s, static_s)}``."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in policies:
            policy = kvpolicy.load_policy(name, budget=budget)
            if policy.mode == "select":  # a selection runs at every step: no step is free of it
                continue
            interval = policy.schedule.interval
            if interval < 2:  # evicts at every step (TOVA): no step is free of an eviction
                continue
            prompt = torch.randint(3, 4096, (batch, budget), generator=gen)
            times: dict[str, list[float]] = {"policy": [], "static": []}
            for _ in range(trials):
                for kind in ("static", "policy"):
                    if kind == "static":
                        model.set_attn_implementation("sdpa")
                        cache = StaticCache(config=model.config, max_cache_len=policy.schedule.capacity)
                    else:
                        cache = KVPolicyCache(policy, model)
                    model(input_ids=prompt, cache=cache, use_cache=True)
                    token = prompt[:, -1:]
                    # budget + 1 .. budget + interval - 1 slots: no eviction is due at any of these.
                    for _ in range(interval - 1):
                        t0 = time.perf_counter()
                        model(input_ids=token, cache=cache, use_cache=True)
                        times[kind].append(time.perf_counter() - t0)
                    if kind == "policy":
                        assert all(s.evictions == 0 for s in cache.stats())
            out[name] = (statistics.median(times["policy"]), statistics.median(times["static"]))
    return out


def print_overhead(results: dict[str, tuple], budget: int, batch: int) -> None:
    print(f"\ndecode step with no eviction due vs StaticCache(budget + interval), budget {budget}, batch {batch}")
    print("policy".ljust(20) + "policy ms".rjust(12) + "static ms".rjust(12) + "overhead".rjust(12))
    for name, (pol, stat) in results.items():
        print(name.ljust(20) + f"{pol * 1e3:12.3f}{stat * 1e3:12.3f}{100 * (pol / stat - 1):+11.1f}%")


def fits(policy: kvpolicy.Policy, model) -> bool:
    """Whether the policy serves this model (a head profile or a calibration file for another
    model's shape does not)."""
    from kvpolicy.hf import model_facts

    cfg = model.config
    try:
        policy.layer_schedules(cfg.num_hidden_layers, cfg.num_key_value_heads)
        policy.check_model_facts(model_facts(model))
    except kvpolicy.PolicyError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="up to 1024 generated tokens")
    ap.add_argument("--max-new", type=int, default=None, help="generated tokens (default 4096, quick 1024)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for a tiny model)")
    ap.add_argument("--policies", nargs="*", default=None, help="default: every built-in policy")
    ap.add_argument("--plot", default=None, help="also write a PNG: tokens/s and KV bytes vs generated length")
    ap.add_argument("--overhead-only", action="store_true", help="only the step-overhead table")
    ap.add_argument("--trials", type=int, default=5, help="alternating trials of the step-overhead table")
    args = ap.parse_args(argv)
    if args.plot:  # found out now, not after the whole run
        if importlib.util.find_spec("matplotlib") is None:
            ap.error("--plot needs matplotlib: pip install matplotlib")
        try:
            check_output(args.plot, "--plot")
        except OSError as exc:
            ap.error(str(exc))
    torch.set_num_threads(args.threads)
    max_new = args.max_new or (1024 if args.quick else 4096)
    checkpoints = [c for c in (128, 256, 512, 1024, 2048, 4096, 8192, 16384) if c < max_new] + [max_new]
    if args.quick:
        checkpoints = [c for c in checkpoints if c >= 256]
    model = build_model()
    policies = args.policies or [  # a policy bound to another model (duo-attention, triattention) is left out
        *sorted(n for n in kvpolicy.available_policies()
                if fits(kvpolicy.load_policy(n), model)),
        "vase-attnv@select",
    ]
    if args.overhead_only:
        print_overhead(step_overhead(model, policies, args.budget, args.trials, args.batch), args.budget, args.batch)
        return
    prompt = torch.randint(3, 4096, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    # Warm-up (allocator, kernels).
    model.set_attn_implementation("sdpa")
    run(model, DynamicCache(config=model.config), prompt, [32])

    results: dict[str, dict] = {}
    model.set_attn_implementation("sdpa")
    results["full"] = run(model, DynamicCache(config=model.config), prompt, checkpoints)
    print(f"full: {results['full']['total_s']:.1f}s", flush=True)
    for name in policies:
        policy = kvpolicy.load_policy(name, budget=args.budget)
        cache = KVPolicyCache(policy, model)
        results[name] = run(model, cache, prompt, checkpoints)
        results[name]["interval"] = policy.schedule.interval
        print(f"{name}: {results[name]['total_s']:.1f}s", flush=True)

    names = ["full", *policies]
    width = max(len(n) for n in names) + 2
    print(f"\nQwen3-tiny float32, batch {args.batch}, prompt {args.prompt}, budget {args.budget}, "
          f"{args.threads} thread(s)\n")
    print("tokens/s over each segment of generated length (segment ends at the column's length)")
    print("policy".ljust(width) + "".join(f"{c:>9}" for c in checkpoints))
    for n in names:
        print(n.ljust(width) + "".join(f"{results[n]['rate'][c]:>9.1f}" for c in checkpoints))
    print("\nKV bytes held (KiB) at each generated length")
    print("policy".ljust(width) + "".join(f"{c:>9}" for c in checkpoints))
    for n in names:
        print(n.ljust(width) + "".join(f"{results[n]['bytes'][c] / 1024:>9.0f}" for c in checkpoints))
    ref = results.get("streamingllm")
    last = checkpoints[-1]
    print(f"\neviction cost over the whole run ({last} tokens)")
    header = ["policy", "interval", "total s", "evict s", "evict %", "calls", "vs streamingllm", "vs full @" + str(last)]
    print("".join(h.rjust(16) if i else h.ljust(width) for i, h in enumerate(header)))
    for n in policies:
        r = results[n]
        share = 100 * r["evict_s"] / r["total_s"]
        vs_stream = f"{100 * (r['total_s'] / ref['total_s'] - 1):+.1f}%" if ref else "-"
        speed = f"{r['rate'][last] / results['full']['rate'][last]:.2f}x"
        row = [n, str(r["interval"]), f"{r['total_s']:.2f}", f"{r['evict_s']:.2f}", f"{share:.1f}%",
               str(r["evict_calls"]), vs_stream, speed]
        print("".join(c.rjust(16) if i else c.ljust(width) for i, c in enumerate(row)))
    print_overhead(step_overhead(model, policies, args.budget, args.trials, args.batch), args.budget, args.batch)
    if args.plot:
        plot(results, names, checkpoints, args)


def plot(results: dict, names: list[str], checkpoints: list[int], args) -> None:
    """Tokens/s and KV bytes against generated length, one line per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        style = {"color": "black", "linewidth": 2.5} if n == "full" else {}
        ax_rate.plot(checkpoints, [results[n]["rate"][c] for c in checkpoints], marker="o", label=n, **style)
        ax_mem.plot(checkpoints, [results[n]["bytes"][c] / 1024 for c in checkpoints], marker="o", label=n, **style)
    for ax, title in ((ax_rate, "decode tokens/s (segment)"), (ax_mem, "KV cache KiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("generated tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_mem.set_yscale("log", base=2)
    ax_rate.legend(fontsize=7, ncol=2)
    fig.suptitle(f"tiny Qwen3, CPU, budget {args.budget}: full cache vs kvpolicy policies")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
