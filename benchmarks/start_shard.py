"""Start one shard of a configuration (a subset of its policies, budgets or metrics) with the full
cache's row, predictions and references copied from an earlier shard of the same configuration,
so that the shard runs only its policies: the full cache's pair (the reference answers, token by
token) takes minutes and gives the same figures every time.

    python benchmarks/start_shard.py CONFIG OUT --from SHARD [--policies P ...] [--budgets N ...] \
        [--metrics M ...]
    kvpolicy eval --resume OUT
    python benchmarks/merge_runs.py CONFIG MERGED SHARD OUT ...

The copied full-cache row must belong to the same protocol: the model, text, dtype, seed and the
settings of every metric the shard runs are compared with the earlier shard's (which must have run
those metrics), and a difference stops here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpolicy.eval.config import EvalConfig
from kvpolicy.eval.runner import RunFolder, plan_run

# What a shard may choose for itself; every other field must equal the earlier shard's, except the
# settings of metrics the shard does not run.
SHARD_FIELDS = ("policies", "budgets", "metrics", "refusals", "resolved_policies")
METRIC_SECTIONS = ("perplexity", "fidelity", "passkey", "accuracy", "reconstruction", "speed", "lm")


def start_shard(data: dict, label: str, out: str | Path, source: str | Path) -> int:
    """Start the shard ``data`` (an ``EvalConfig`` mapping; ``label`` names it in errors) in
    ``out`` with ``source``'s full-cache row; returns the pairs left to run."""
    source = Path(source)
    theirs = EvalConfig.load(source / "config.yaml").model_dump()
    missing = sorted(set(data["metrics"]) - set(theirs["metrics"]))
    if missing:
        raise SystemExit(f"{source} did not run {', '.join(missing)}: its full-cache row has no such figures")
    skipped = set(SHARD_FIELDS) | (set(METRIC_SECTIONS) - set(data["metrics"]))
    differs = sorted(k for k in data.keys() - skipped if data[k] != theirs.get(k))
    if differs:
        raise SystemExit(f"{source} was run with other settings than {label}: {', '.join(differs)}")
    plan = plan_run(EvalConfig.model_validate(data))
    full = [ln for ln in (source / "results.jsonl").read_text(encoding="utf-8").splitlines()
            if ln.strip() and json.loads(ln)["key"] == "full"]
    if not full:
        raise SystemExit(f"{source} has no finished full-cache row")
    folder = RunFolder.new(out)
    folder.write_config(plan)
    preds = [ln for ln in (source / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
             if ln.strip() and json.loads(ln).get("key") == "full"]
    folder.predictions_file.write_text("".join(p + "\n" for p in preds), encoding="utf-8")
    folder.results_file.write_text(full[0] + "\n", encoding="utf-8")
    folder.reference_file.write_text((source / "reference.json").read_text(encoding="utf-8"), encoding="utf-8")
    return len(plan.pairs) - 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--from", dest="source", required=True, help="a shard whose full-cache row is done")
    ap.add_argument("--policies", nargs="+")
    ap.add_argument("--budgets", nargs="+", type=int)
    ap.add_argument("--metrics", nargs="+")
    args = ap.parse_args(argv)
    data = EvalConfig.load(args.config).model_dump()
    for name in ("policies", "budgets", "metrics"):
        if getattr(args, name):
            data[name] = getattr(args, name)
            if name != "metrics":  # other pairs than a saved run's: resolved from their names and files
                data.pop("resolved_policies", None)
    pairs = start_shard(data, args.config, args.out, args.source)
    print(f"{args.out}: {pairs} pairs to run: kvpolicy eval --resume {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
