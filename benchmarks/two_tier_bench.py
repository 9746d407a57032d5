"""The decode step of two-tier policies against eviction at the same attended count, side by side.

    python benchmarks/two_tier_bench.py snapkv@256 docs/examples/two-tiers/snapkv-recall.yaml@128 \
        [--tokens 2048] [--warmup 512] [--block 32]

Each ``POLICY@BUDGET`` (a registered name or a YAML file; the budget is ``schedule.budget``, so a
two-tier policy with ``recall.budget`` 128 at ``@128`` attends 256 slots, as ``snapkv@256`` does)
decodes the bundled model over the ranking text token by token (a 64-token prompt, then one token
per step, teacher-forced), all of them in turn, ``--block`` steps each, so the machine's load falls
on every policy alike. Prints per policy the mean decode step after ``--warmup`` tokens, its ratio
to the first policy's, and for a two-tier policy the bytes moved from the slow tier per step, the
recall hit rate and each tier's bytes at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvpolicy import load_policy
from kvpolicy.eval.data import read_text, text_ids
from kvpolicy.eval.decoding import cache_argument, new_cache
from kvpolicy.eval.models import load_model, load_tokenizer, resolve_model


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="+", help="POLICY@BUDGET (the first is the reference)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=512, help="tokens decoded before steps are timed")
    ap.add_argument("--block", type=int, default=32, help="steps each policy decodes before the next takes over")
    args = ap.parse_args(argv)

    source = resolve_model("bundled")
    model = load_model(source)
    ids = text_ids(load_tokenizer(source), read_text(None)[0])[: args.tokens]
    arg = cache_argument(model)
    runs = []
    for spec in args.policies:
        name, _, budget = spec.rpartition("@")
        policy = load_policy(name, budget=int(budget))
        cache = new_cache(model, policy)
        runs.append({"spec": spec, "cache": cache, "times": []})
    with torch.inference_mode():
        for run in runs:  # the prompt
            model(input_ids=torch.tensor([ids[:64]]), use_cache=True, logits_to_keep=1, **{arg: run["cache"]})
        pos = 64
        while pos < len(ids):
            stop = min(len(ids), pos + args.block)
            for run in runs:
                for t in range(pos, stop):
                    start = time.perf_counter()
                    model(input_ids=torch.tensor([[ids[t]]]), use_cache=True, logits_to_keep=1, **{arg: run["cache"]})
                    if t >= args.warmup:
                        run["times"].append(time.perf_counter() - start)
            pos = stop
    ref = statistics.fmean(runs[0]["times"])
    steps = len(ids) - max(64, args.warmup)
    print(f"bundled model, CPU, {torch.get_num_threads()} threads; {len(ids)} tokens, {steps} timed steps each")
    for run in runs:
        mean = statistics.fmean(run["times"])
        line = f"{run['spec']:<48} step {mean * 1e3:7.2f} ms  x{mean / ref:.3f}"
        tiers = run["cache"].evicting.tier_stats()
        if tiers is not None:
            decoded = len(ids) - 64
            hit = tiers.hits / max(1, tiers.pages_recalled)
            line += (f"  moved {tiers.moved_bytes / decoded / 1024:.1f} KiB/step, hits {hit:.1%}, fast "
                     f"{tiers.fast_bytes / 2**20:.1f} MiB, slow {tiers.slow_bytes / 2**20:.1f} MiB")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
