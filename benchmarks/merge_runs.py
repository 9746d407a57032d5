"""Merge the run folders of one configuration run in pieces (shards run side by side, each with
``--policies``/``--budgets`` of its own) into one folder, then write its tables and plots.

    python benchmarks/merge_runs.py CONFIG OUT SHARD [SHARD ...]
    kvpolicy eval --report OUT

OUT gets CONFIG as its ``config.yaml`` (policies resolved now), every finished pair of the shards
(a pair finished in two shards must have the same figures in both, or the merge stops), their
predictions and the full cache's references. The figures are the shards' own: nothing is run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpolicy.eval.config import EvalConfig
from kvpolicy.eval.runner import RunFolder, plan_run


def main(argv: list[str]) -> int:
    config_path, out, *shards = argv
    plan = plan_run(EvalConfig.load(config_path))
    folder = RunFolder.new(out)
    folder.write_config(plan)
    wanted = {p.key for p in plan.pairs}
    rows: dict[str, dict] = {}
    source: dict[str, Path] = {}
    for shard in map(Path, shards):
        for line in (shard / "results.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            key = row["key"]
            if key not in wanted:
                raise SystemExit(f"{shard}: pair {key} is not in {config_path}")
            if key in rows:
                a, b = rows[key]["values"], row["values"]
                if a != b:  # deterministic figures: a pair run twice must agree exactly
                    raise SystemExit(f"{key}: {shard} and {source[key]} disagree: {b} against {a}")
                continue
            rows[key] = row
            source[key] = shard
    refs: dict = {}
    for shard in map(Path, shards):
        for name, ref in json.loads((shard / "reference.json").read_text(encoding="utf-8")).items():
            if refs.setdefault(name, ref) != ref:
                raise SystemExit(f"{shard}: the full cache's {name} reference differs from another shard's")
    folder.save_references(refs)
    for key in [p.key for p in plan.pairs if p.key in rows]:
        shard = source[key]
        preds = [json.loads(x) for x in (shard / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
                 if x.strip()]
        folder.append(rows[key], [p for p in preds if p.get("key") == key])
    missing = sorted(wanted - set(rows))
    print(f"{out}: {len(rows)} of {len(wanted)} pairs" + (f"; not run: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
