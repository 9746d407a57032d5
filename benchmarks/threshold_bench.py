"""Threshold selection against a fixed budget at the same mean held bytes, on the bundled model.

    python benchmarks/threshold_bench.py [--tokens 2048] [--prefill 64] [--thresholds -17.0] [--out FILE]

For each threshold, ``dms`` (key-norm score buffered at arrival, protected window ``--recent``,
evicting every ``--interval`` tokens once a token has left the window, pool ``--pool`` slots per
head) streams the bundled text (``kvpolicy eval``'s streaming perplexity: its ``Stream`` and
``token_nll``, ``--prefill`` tokens of prompt, then exact chunks). Its mean held KV (head-slots
summed over layers and heads, averaged over every token of the text, times the bytes of a key
and a value) is measured; then the fixed-budget policy with the same scorer and window (key norm,
greedy, the same recent buffer and interval) runs at the budget whose mean held KV is closest
(computed exactly from the schedule: a fixed budget's counts do not depend on the text). Printed
per threshold: perplexity of both and of the full cache, their mean held KV, and the spread
(min / median / max) of dms's per-head counts at the end of the text, over every layer and head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import kvpolicy
from kvpolicy.eval.data import read_text, text_ids
from kvpolicy.eval.decoding import Stream
from kvpolicy.eval.metrics.perplexity import perplexity, token_nll
from kvpolicy.eval.models import load_model, load_tokenizer, resolve_model
from kvpolicy.files import check_output, replace_file


def dms(threshold: float, pool: int, recent: int, interval: int) -> kvpolicy.Policy:
    return kvpolicy.load_policy({
        "name": f"dms@{threshold:g}",
        "schedule": {"budget": pool, "recent": recent, "interval": interval, "window": 0, "compress_prompt": True,
                     "evict_above": "recent"},
        "scorer": {"type": "arrival_score", "scorer": {"type": "key_norm", "low_norm_first": True}},
        "selector": {"type": "threshold", "threshold": threshold},
    })


def fixed(budget: int, recent: int, interval: int) -> kvpolicy.Policy:
    return kvpolicy.load_policy({
        "name": f"key_norm@{budget}",
        "schedule": {"budget": budget, "recent": recent, "interval": interval, "window": 0, "compress_prompt": True},
        "scorer": {"type": "key_norm", "low_norm_first": True}, "selector": {"type": "greedy"},
    })


def fixed_mean_held(budget: int, recent: int, interval: int, tokens: int, prefill: int) -> float:
    """Slots one head of a fixed-budget policy holds after each token, averaged over the text:
    the schedule alone decides them (the prompt compressed once it is in, then every
    ``interval`` slots cut back to the budget)."""
    sched = fixed(budget, recent, interval).schedule
    held, total = prefill, sum(range(1, prefill + 1))  # the prompt, one chunk: i slots after its i-th token
    if sched.due(held, held, prompt=True):
        held = budget
    for t in range(prefill + 1, tokens + 1):
        if sched.due(held, t - 1):
            held = budget
        held += 1
        total += held
    return total / tokens


def equal_budget(per_head: float, recent: int, interval: int, tokens: int, prefill: int) -> int:
    """The fixed budget whose mean held slots per head (``fixed_mean_held``, which grows with the
    budget) is closest to ``per_head``: bisection, then the nearer neighbour."""
    lo, hi = recent + 1, tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if fixed_mean_held(mid, recent, interval, tokens, prefill) < per_head:
            lo = mid + 1
        else:
            hi = mid
    near = [b for b in (lo - 1, lo) if b > recent]
    return min(near, key=lambda b: abs(fixed_mean_held(b, recent, interval, tokens, prefill) - per_head))


def run(model, ids: list[int], prefill: int, policy: kvpolicy.Policy | None) -> dict:
    """Streaming perplexity of ``ids`` under ``policy`` (None: the full cache), with the head-slots
    held after every token (dms: read off the cache's stats after each chunk)."""
    stream = Stream(model, policy)
    targets = torch.tensor(ids)
    nll = torch.zeros(len(ids) - 1)
    held_sum = [0.0]
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads

    def collect(base: int, start: int, logits: torch.Tensor) -> None:
        pos = base + start
        stop = min(pos + logits.shape[0], len(ids) - 1)
        if stop > pos:
            nll[pos:stop] = token_nll(logits[: stop - pos], targets[pos + 1 : stop + 1])
        if policy is not None:  # held after the chunk's last token; each earlier token held one less per head
            end = sum(s.head_slots_held for s in stream.cache.stats())
            t = logits.shape[0]
            held_sum[0] += t * end - per_token * t * (t - 1) / 2

    stream.feed(ids[:prefill], lambda o, lg: collect(0, o, lg))
    stream.feed(ids[prefill:], lambda o, lg: collect(prefill, o, lg))
    out = {"ppl": perplexity(float(nll.sum()), nll.numel()), "nll": float(nll.mean())}
    if policy is not None:
        out["mean_head_slots"] = held_sum[0] / len(ids)
        counts = torch.cat([stream.cache.evicting.head_counts(layer).flatten()
                            for layer in range(model.config.num_hidden_layers)]).tolist()
        out["head_counts"] = {"min": min(counts), "median": statistics.median(counts), "max": max(counts)}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[-17.0])
    ap.add_argument("--pool", type=int, default=1024, help="dms's budget: the slots each head may hold at most")
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.out is not None:  # found out now, not after the whole run
        try:
            check_output(args.out, "--out")
        except OSError as exc:
            ap.error(str(exc))

    t0 = time.perf_counter()
    source = resolve_model("bundled")
    model, tok = load_model(source), load_tokenizer(source)
    ids = text_ids(tok, read_text(None)[0])[: args.tokens]
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads
    kv_bytes = 2 * (cfg.hidden_size // cfg.num_attention_heads) * next(model.parameters()).element_size()
    full = run(model, ids, args.prefill, None)
    rows = []
    for threshold in args.thresholds:
        thr = run(model, ids, args.prefill, dms(threshold, args.pool, args.recent, args.interval))
        per_head = thr["mean_head_slots"] / per_token
        budget = equal_budget(per_head, args.recent, args.interval, args.tokens, args.prefill)
        fix = run(model, ids, args.prefill, fixed(budget, args.recent, args.interval))
        rows.append({"threshold": threshold, "dms": thr, "fixed_budget": budget, "fixed": fix})
        print(f"threshold {threshold:g}: dms ppl {thr['ppl']:.3f} (x{thr['ppl'] / full['ppl']:.4f} full) at "
              f"{thr['mean_head_slots'] * kv_bytes / 2**20:.2f} MiB mean held KV ({per_head:.1f} slots per head); "
              f"fixed budget {budget}: ppl {fix['ppl']:.3f} (x{fix['ppl'] / full['ppl']:.4f}) at "
              f"{fix['mean_head_slots'] * kv_bytes / 2**20:.2f} MiB; dms per-head counts at the end "
              f"min/median/max {thr['head_counts']['min']}/{thr['head_counts']['median']}/{thr['head_counts']['max']}",
              flush=True)
    print(f"full cache ppl {full['ppl']:.3f}; {args.tokens} tokens, prefill {args.prefill}, "
          f"{time.perf_counter() - t0:.0f} s")
    if args.out is not None:
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "full": full, "rows": rows}
        replace_file(args.out, json.dumps(record, indent=2).encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
