"""Latency of ``Policy.select`` for every built-in policy, against a compute floor and a loop.

For each policy and shape it times, side by side on the same tensors:

* ``select``: ``Policy.select`` (all rows and heads at once);
* ``floor``: the bare batched ``Q K^T`` matmul (for policies that score key redundancy, plus the
  row-chunked ``K K^T``), the least work an attention-based eviction has to do;
* ``loop``: a straightforward per-row, per-head Python loop implementation of the same policy.

Usage::

    python benchmarks/select_bench.py            # full run (minutes on a small CPU)
    python benchmarks/select_bench.py --quick    # fewer repeats
    python benchmarks/select_bench.py --policies snapkv rkv --batch 1 --slots 1088
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kvpolicy

# -- timing -------------------------------------------------------------------------------------


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median milliseconds of each function, timed in turn within every repeat.

    Interleaving keeps the comparison fair on a shared machine: a burst of load from elsewhere
    slows every contender of that repeat, not just one of them.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


# -- the compute floor --------------------------------------------------------------------------


def qk_floor(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    b, hkv, _, d = keys.shape
    q = queries.reshape(b, hkv, -1, d)
    return torch.matmul(q, keys.transpose(-1, -2))


def kk_floor(keys: torch.Tensor, chunk_elements: int = 1 << 25) -> None:
    b, h, n, _ = keys.shape
    kt = keys.transpose(-1, -2)
    rows = max(1, chunk_elements // (b * h * n))
    for start in range(0, n, rows):
        torch.matmul(keys[:, :, start : start + rows], kt)


def uses_redundancy(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec["type"] == "redundancy":
        return True
    if spec["type"] == "combination":
        return any(uses_redundancy(t["scorer"]) for t in spec["terms"])
    return False


# -- the per-row, per-head loop implementation ----------------------------------------------------


class LoopPolicy:
    """The same policy written the obvious way: one (row, KV head) at a time, for the stages
    ``covers`` lists (the VaSE family's and SnapKV's); other policies get no loop column."""

    SCORERS = frozenset({"attention", "redundancy", "leverage", "value_magnitude", "random", "combination"})
    RESERVATIONS = frozenset({"sinks", "top_scores"})
    SELECTORS = frozenset({"greedy", "stochastic", "keep_protected"})

    @classmethod
    def covers(cls, policy: kvpolicy.Policy) -> bool:
        """Whether the loop implements every stage of ``policy``: its scorers (nested ones too),
        reservations and selector, with uniform budgets, no merge and no state."""
        cfg = policy.config.to_dict()

        def scorer_ok(spec: dict | None) -> bool:
            if spec is None:
                return True
            if spec["type"] == "combination":
                return all(scorer_ok(term["scorer"]) for term in spec["terms"])
            if spec["type"] == "attention" and spec.get("softmax_over", "candidates") != "candidates":
                return False  # the loop normalises over the candidates only
            return spec["type"] in cls.SCORERS

        return (scorer_ok(cfg.get("scorer")) and cfg["selector"]["type"] in cls.SELECTORS
                and all(r["type"] in cls.RESERVATIONS and scorer_ok(r.get("scorer")) for r in cfg.get("reservations", []))
                and not policy.per_head and not policy.stateful_stages
                and (cfg.get("allocation") or {"type": "uniform"})["type"] == "uniform"
                and (cfg.get("merge") or {"type": "drop"})["type"] == "drop")

    def __init__(self, policy: kvpolicy.Policy) -> None:
        self.cfg = policy.config.to_dict()
        s = self.cfg["schedule"]
        self.budget, self.recent = s["budget"], s["recent"]

    def select(self, keys, values, queries, generator: torch.Generator) -> torch.Tensor:
        b_, hkv, n, _ = keys.shape
        g = queries.shape[1] // hkv
        budget = min(n, self.budget)
        if n <= self.budget:
            return torch.arange(n).expand(b_, hkv, n)
        c = n - self.recent
        out = torch.empty(b_, hkv, budget, dtype=torch.long)
        projections = self._projections(keys, generator)
        for b in range(b_):
            for h in range(hkv):
                k, v = keys[b, h], values[b, h]
                q = queries[b, h * g : (h + 1) * g]
                protected = torch.zeros(n, dtype=torch.bool)
                protected[c:] = True
                for res in self.cfg["reservations"]:
                    protected |= self._reserve(res, k, v, q, c, protected, budget)
                sel = self.cfg["selector"]["type"]
                kept = protected.nonzero().squeeze(-1)
                free = budget - kept.numel()
                if sel != "keep_protected" and free > 0:
                    p = projections[b] if projections is not None else None
                    s = self._score(self.cfg["scorer"], k, v, q, c, generator, p)
                    open_ = ~protected[:c]
                    if sel == "greedy":
                        s = s.masked_fill(~open_, float("-inf"))
                        extra = s.topk(free).indices
                    else:
                        w = s.masked_fill(~open_, 0.0)
                        extra = torch.multinomial(w, free, replacement=False, generator=generator)
                    kept = torch.cat([kept, extra])
                elif free > 0:
                    extra = (~protected[:c]).nonzero().squeeze(-1)[-free:]
                    kept = torch.cat([kept, extra])
                out[b, h] = kept.sort().values
        return out

    def _projections(self, keys, generator):
        spec = self.cfg["scorer"]
        if spec is None or spec["type"] != "leverage":
            return None
        b, d, r = keys.shape[0], keys.shape[3], spec["rank"]
        if spec["projection"] == "fixed":
            gen = torch.Generator().manual_seed(self.cfg["seed"] or 0)
            p = torch.randn(d, r, generator=gen) / math.sqrt(r)
            return [p] * b
        return [torch.randn(d, r, generator=generator) / math.sqrt(r) for _ in range(b)]

    def _reserve(self, spec, k, v, q, c, protected, budget):
        n = k.shape[0]
        if spec["type"] == "sinks":
            out = torch.zeros(n, dtype=torch.bool)
            out[: spec["n"]] = True
            return out
        # top_scores over value Range
        cnt = spec["n"] if isinstance(spec["n"], int) else int(spec["n"] * budget)
        if spec["include_prior"]:
            cnt -= int(protected[:c].sum())
        s = self._score(spec["scorer"], k, v, q, c, None, None)
        s = s.masked_fill(protected[:c], float("-inf"))
        out = torch.zeros(n, dtype=torch.bool)
        if cnt > 0:
            out[s.topk(cnt).indices] = True
        return out

    def _score(self, spec, k, v, q, c, generator, proj) -> torch.Tensor:
        t = spec["type"]
        if t == "attention":
            d = k.shape[-1]
            logits = torch.matmul(q, k[:c].T) / math.sqrt(d)  # [G, W, C]
            if spec["group_reduce_at"] == "before_softmax":
                logits = logits.amax(0, keepdim=True) if spec["group_reduce"] == "max" else logits.mean(0, True)
            p = logits.softmax(-1)
            s = p.mean(1) if spec["window_reduce"] == "mean" else p.sum(1)  # [G', C]
            if spec["pooling"] == "avg":
                s = F.avg_pool1d(s[:, None], spec["kernel"], 1, spec["kernel"] // 2)[:, 0]
            elif spec["pooling"] == "max":
                s = F.max_pool1d(s[:, None], spec["kernel"], 1, spec["kernel"] // 2)[:, 0]
            return s.amax(0) if spec["group_reduce"] == "max" else s.mean(0)
        if t == "redundancy":
            m = k.shape[0] if spec["over"] == "all" else c
            kn = k[:m] / (k[:m].norm(dim=-1, keepdim=True) + 1e-8)
            sim = kn @ kn.T
            sim.fill_diagonal_(0.0)
            if spec["threshold"] is not None:
                cols = torch.arange(m)
                last = torch.where(sim > spec["threshold"], cols, 0).amax(-1)
                sim[cols, last] = 0.0
            return sim.mean(0).softmax(-1)[:c]
        if t == "leverage":
            k2 = (k[:c] @ proj).square().sum(-1)
            v2 = (v[:c] @ proj).square().sum(-1)
            s = {"kv_product": k2 * v2, "key": k2, "value": v2}.get(spec["mode"])
            if s is None:
                s = 0.5 * (k2 / k2.sum() + v2 / v2.sum())
            return s / s.sum()
        if t == "value_magnitude":
            vc = v[:c]
            return vc.amax(-1) - vc.amin(-1)
        if t == "random":
            return torch.rand(c, generator=generator)
        if t == "combination":
            return sum(term["weight"] * self._score(term["scorer"], k, v, q, c, generator, proj)
                       for term in spec["terms"])
        raise NotImplementedError(t)


# -- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--policies", nargs="*", default=None, help="default: every built-in policy")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--slots", type=int, nargs="*", default=[1088, 4160])
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); 1 is steadier on a shared machine")
    ap.add_argument("--no-loop", action="store_true", help="skip the loop implementation")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    registry = kvpolicy.get_registry()
    # Policies whose stages read the model (RoPE, output projections) need a model's facts, which
    # random tensors have none of: left out, and refused by name, before anything is timed.
    names = args.policies or sorted(n for n, r in registry.policies.items()
                                    if r.plugin == "kvpolicy" and not kvpolicy.load_policy(n).needs_model)
    try:
        needs_model = [n for n in names if kvpolicy.load_policy(n).needs_model]
    except kvpolicy.PolicyError as err:
        ap.error(str(err).splitlines()[-1].strip())
    if needs_model:
        ap.error(f"{', '.join(needs_model)}: the policy reads the model (its RoPE, output projections), and the "
                 "random tensors timed here come from no model: time it on a model instead (decode_bench.py)")

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU, "
          f"Hkv={args.kv_heads} Hq={args.q_heads} D={args.head_dim} W={args.window} "
          f"budget={args.budget}, median of {repeats}")
    header = f"{'policy':<18} {'B':>2} {'N':>5} {'select ms':>10} {'floor ms':>9} {'ratio':>6} {'loop ms':>9} {'speed-up':>8}"
    print(header)
    print("-" * len(header))
    for name in names:
        policy = kvpolicy.load_policy(name, budget=args.budget)
        try:  # a head profile bound to its model's shape (duo-attention) cannot score these tensors
            policy.layer_schedules(1, args.kv_heads)
        except kvpolicy.PolicyError as err:
            print(f"{name:<18} skipped: {str(err).splitlines()[-1].strip()}", flush=True)
            continue
        loop = LoopPolicy(policy) if LoopPolicy.covers(policy) else None
        # a policy keeping a count per head (Ada-KV, thresholds) is timed through select_heads
        select = policy.select_heads if policy.per_head else policy.select
        if policy.needs_prompt:  # random-prompt keeps the prompt: one of 64 tokens, as the ranking's
            select = functools.partial(select, prompt_lengths=64)
        for b in args.batch:
            for n in args.slots:
                gen = torch.Generator().manual_seed(0)
                keys = torch.randn(b, args.kv_heads, n, args.head_dim, generator=gen)
                values = torch.randn(b, args.kv_heads, n, args.head_dim, generator=gen)
                queries = torch.randn(b, args.q_heads, args.window, args.head_dim, generator=gen)
                rkv = uses_redundancy(policy.config.to_dict()["scorer"])

                def floor(keys=keys, queries=queries, rkv=rkv):
                    qk_floor(keys, queries)
                    if rkv:
                        kk_floor(keys)

                fns = {
                    "select": functools.partial(select, keys, values, queries),
                    "floor": floor,
                }
                if loop is not None and not args.no_loop:
                    fns["loop"] = functools.partial(loop.select, keys, values, queries, gen)
                ms = interleaved_ms(fns, repeats)
                sel_ms, floor_ms, loop_ms = ms["select"], ms["floor"], ms.get("loop", float("nan"))
                looped = f"{loop_ms:>9.1f} {loop_ms / sel_ms:>7.1f}x" if "loop" in ms else f"{'-':>9} {'-':>8}"
                print(f"{name:<18} {b:>2} {n:>5} {sel_ms:>10.1f} {floor_ms:>9.1f} {sel_ms / floor_ms:>6.2f} {looped}",
                      flush=True)


if __name__ == "__main__":
    main()
