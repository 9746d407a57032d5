"""Streaming perplexity of policies over several seeds: the mean and spread of a sampled policy,
where one seed's figure says little (VaSE-AttnV's seed alone moves its ratio at budget 256 by
0.0056 on the bundled model).

    python benchmarks/seed_spread.py vase-attnv docs/examples/quality-goal/v-t2.yaml \
        --seeds 0 1 2 3 --budgets 256 --out runs/seeds [--full-from RUN] [--target 1.0246] \
        [--refusals report]

Each policy (a registered name or a YAML file) runs once per seed, as ``NAME#sSEED``, through
``kvpolicy eval`` (metric ``perplexity``, 4,096 tokens of the bundled text with a 64-token
prompt: the ranking run's protocol); a policy that samples nothing runs once. ``--full-from``
copies the full cache's row from an earlier run of the same protocol (``benchmarks/start_shard.py``)
instead of running it; an interrupted run continues with the same command and ``--resume``.
Prints one line per policy and budget: every seed's ratio to the full cache, their mean and
standard deviation, and the mean's distance above ``--target`` (the oracle's ratio).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvpolicy import load_policy
from kvpolicy.eval.config import EvalConfig
from kvpolicy.eval.runner import run_eval

sys.path.insert(0, str(Path(__file__).resolve().parent))
from start_shard import start_shard  # noqa: E402  (a sibling script, not a package)


def variants(sources: list[str], seeds: list[int]) -> list[dict]:
    """One policy mapping per (policy, seed); one only for a policy that samples nothing."""
    out = []
    for source in sources:
        policy = load_policy(source)
        data = policy.config.model_dump(mode="json", exclude_defaults=True)
        for seed in seeds if policy.stochastic else seeds[:1]:
            out.append({**data, "name": f"{policy.name}#s{seed}", "seed": seed})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="+")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--budgets", nargs="+", type=int, default=[256])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--model", default="bundled", help="as kvpolicy eval's --model (default: the bundled model)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--full-from", help="a run folder of the same protocol whose full-cache row is done")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    ap.add_argument("--target", type=float, help="the ratio to measure the means against (the oracle's)")
    ap.add_argument("--refusals", choices=["error", "report"], default="error",
                    help="as the eval config's `refusals`: report shows a policy that refuses a budget "
                         "(dms's 128-token window at 128) instead of stopping before any pair runs")
    args = ap.parse_args(argv)

    config = EvalConfig.model_validate({
        "model": args.model, "budgets": args.budgets, "metrics": ["perplexity"],
        "perplexity": {"tokens": args.tokens, "prefill": 64},
        "policies": variants(args.policies, args.seeds), "refusals": args.refusals,
    })
    out = Path(args.out)
    if args.resume:
        result = run_eval(None, resume=out, progress=False)
    else:
        if args.full_from:
            start_shard(config.model_dump(), "these seed runs", out, args.full_from)
            result = run_eval(None, resume=out, progress=False)
        else:
            result = run_eval(config, out, progress=False)

    ratios: dict[tuple[str, int], list[float]] = {}
    refused: dict[tuple[str, int], str] = {}
    for row in result.rows:
        if row.get("refused"):
            refused[(row["policy"].split("#s")[0], row["budget"])] = row["refused"]
        if row["key"] == "full" or "ppl_ratio" not in row["values"]:
            continue
        base = row["policy"].split("#s")[0]
        ratios.setdefault((base, row["budget"]), []).append(row["values"]["ppl_ratio"])
    for (name, budget), values in ratios.items():
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        above = f"  {mean - args.target:+.4f} from the target" if args.target is not None else ""
        print(f"{name}@{budget}: {' '.join(f'{v:.4f}' for v in values)}  mean {mean:.4f} sd {sd:.4f}{above}")
    for (name, budget), reason in refused.items():
        print(f"{name}@{budget}: refused: {' '.join(reason.split())}")  # the policy's error, on one line
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
