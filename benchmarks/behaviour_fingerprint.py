"""A fingerprint of what users see, for before/after comparisons of a refactor.

``generate()`` tokens, per-layer stats, memory, per-row counts and evictions and layer 0's views
of every built-in policy (and five select-mode variants), greedy, on a tiny random Qwen3 with a
left-padded batch of 2, at 1 and 2 beams, budget 16 so that every policy evicts; plus a
hand-written ``EvictingCache.attend`` loop (padding, a chunk, ``select_rows``,
``tokens_to_next_eviction``) and ``step()``. Run it against two source trees and compare::

    PYTHONPATH=OLD/src python benchmarks/behaviour_fingerprint.py before.pt
    PYTHONPATH=src python benchmarks/behaviour_fingerprint.py after.pt
    python benchmarks/behaviour_fingerprint.py --compare before.pt after.pt

The comparison is exact (``torch.equal``) and names every record that differs; policies present
on one side only are listed, not compared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny-model helpers

import torch  # noqa: E402
from hf_util import fresh, generate, left_padded_prompt, tiny_qwen3  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy import EvictingCache, KVPolicyCache, load_policy  # noqa: E402
from kvpolicy.hf import model_facts  # noqa: E402


def fingerprint(names: list[str] | None = None) -> dict:
    """The records of ``names`` (default: every built-in, and five select-mode variants)."""
    torch.set_num_threads(1)
    VOCAB = 512
    every = names is None
    names = kvpolicy.available_policies() if names is None else names
    variants = [(n, {}) for n in names]
    if every:
        variants += [(n, {"mode": "select"}) for n in ("snapkv", "vase-attnv", "ada-snapkv", "ada-vase-attnv", "pyramidkv")]
    model = tiny_qwen3(layers=4, vocab=VOCAB)
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=28, pads=(0, 7))
    out = {}
    t0 = time.time()
    for name, extra in variants:
        base = load_policy(name, **extra)
        s = base.schedule
        over = {"budget": 16, "interval": 4, "recent": min(s.recent, 4) if s.recent else 0, **extra}
        if s.window > 0:
            over["window"] = 4
        if base.mode == "select" and name in ("quest", "oracle-topk"):
            over = {"budget": 16, "recent": min(s.recent, 4), **extra}
        if name == "streamingllm":
            over["recent"] = 12
        if any(r.type_name == "prompt" for r in base.config.reservations):  # keeps the prompt: 28 tokens here
            over["budget"] = 32
        policy = load_policy(name, **over) if base.config.recall is None else two_tiers_small(base, over)
        label = name + ("@select" if extra else "")
        try:  # duo-attention and triattention are bound to their files' model, not the 4-layer test model
            policy.layer_schedules(4, 2)
            policy.check_model_facts(model_facts(model))
        except kvpolicy.PolicyError:
            out[(label, "skipped")] = "bound to another model's shape"
            continue
        for beams in (1, 2):
            m = fresh(model)
            cache = KVPolicyCache(policy, m)
            kw = {"num_beams": beams} if beams > 1 else {}
            toks = generate(m, cache, ids, mask, 40, **kw)
            ev = cache.evicting
            rec = {
                "tokens": toks,
                "stats": [(st.evictions, st.tokens_seen, st.slots_held, st.slots_evicted) for st in ev.stats()],
                "memory": ev.memory_bytes(),
                "counts": [v.counts for v in ev.layers],
                "row_evictions": [v.evictions.tolist() for v in ev.layers],
            }
            v0 = ev.layers[0]
            rec["view"] = (v0.keys.clone(), v0.values.clone(), v0.valid.clone(), v0.positions.clone())
            out[(label, beams)] = rec
        if policy.needs_model:  # a hand-written loop has no model to give facts of
            continue
        # the step API with a hand-written loop, chunked prefill + decode, left padding
        torch.manual_seed(1)
        cache = EvictingCache(policy, 2)
        b, hkv, hq, d = 2, 2, 4, 8
        valid = torch.ones(b, 11, dtype=torch.bool)
        valid[1, :4] = False
        outs = []
        for step in range(40):
            t = 11 if step == 0 else (3 if step == 20 else 1)
            tv = valid if step == 0 else None
            for layer in range(2):
                q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
                outs.append(cache.attend(layer, q, k, v, token_valid=tv))
            if step == 30:
                cache.select_rows([1, 0])
            out[(label, "tte", step)] = cache.tokens_to_next_eviction()
        out[(label, "step-api")] = torch.stack([o.flatten() for o in outs if o.shape[2] == 1])
        out[(label, "step-api-stats")] = [(st.evictions, st.tokens_seen, st.slots_held, st.slots_evicted) for st in cache.stats()]
        # step(): what a hand-written attention gets
        cache2 = EvictingCache(policy, 1)
        torch.manual_seed(2)
        got = []
        for step in range(30):
            t = 9 if step == 0 else 1
            k = torch.randn(b, hkv, t, d)
            kk, vv, va = cache2.step(0, k, torch.randn(b, hkv, t, d), torch.randn(b, hq, t, d))
            got.append((kk.clone(), vv.clone(), va.clone()))
        out[(label, "step")] = got
        print(label, "ok", round(time.time() - t0, 1), flush=True)
    return out


def two_tiers_small(base, over: dict):
    """A two-tier policy at the fingerprint's small schedule: its pages (recall's, and a paged
    scorer's) of 4 slots, so that they divide the interval of 4 and fit the budget of 16."""
    data = base.config.to_dict()
    data["schedule"] = {**data["schedule"], **over}
    for stage in (data["recall"], data["recall"]["scorer"], data["scorer"]):
        if "page_size" in stage:
            stage["page_size"] = 4
    return load_policy(data)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="write the fingerprint here (.pt)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprints")
    args = ap.parse_args()
    if args.compare:
        a, b = (torch.load(p, weights_only=False) for p in args.compare)
        common = [k for k in a if k in b]
        differ = [k for k in common if not same(a[k], b[k])]
        only = sorted({str(k[0]) for k in a.keys() ^ b.keys()})
        print(f"{len(common)} records compared, {len(differ)} differ" + (f"; on one side only: {only}" if only else ""))
        for k in differ:
            print("  differs:", k)
        return 1 if differ else 0
    if not args.out:
        ap.error("give OUT.pt, or --compare BEFORE AFTER")
    torch.save(fingerprint(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
