"""Merge the run folders of one configuration run in pieces (shards run side by side, each with
``--policies``/``--budgets``/``--metrics`` of its own) into one folder, then write its tables and plots.

    python benchmarks/merge_runs.py CONFIG OUT SHARD [SHARD ...]
    kvpolicy eval --report OUT

OUT gets CONFIG as its ``config.yaml`` (policies resolved now), every finished pair of the shards,
their predictions and the full cache's references. A pair may be split over shards by metric (its
perplexity in one, its passkey in another): its values are the union, and its seconds the sum. A
figure that two shards both have must be equal in both (the figures are deterministic), or the
merge stops. The figures are the shards' own: nothing is run. ``benchmarks/start_shard.py`` starts
a shard with the full cache's row of an earlier one, so that it is not run again.
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
    sources: dict[str, list[Path]] = {}
    for shard in map(Path, shards):
        for line in (shard / "results.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            key = row["key"]
            if key not in wanted:
                raise SystemExit(f"{shard}: pair {key} is not in {config_path}")
            if key not in rows:
                rows[key] = row
                sources[key] = [shard]
                continue
            merged, new = rows[key]["values"], row["values"]
            clash = {k: (merged[k], new[k]) for k in merged.keys() & new.keys() if merged[k] != new[k]}
            if clash:
                raise SystemExit(f"{key}: {shard} and {sources[key][0]} disagree: {clash}")
            if new.keys() <= merged.keys():  # the same pair run twice: one copy
                continue
            rows[key] = {**rows[key], "values": {**merged, **new},
                         "seconds": round(rows[key]["seconds"] + row["seconds"], 2)}
            sources[key].append(shard)
    refs: dict = {}
    for shard in map(Path, shards):
        for name, ref in json.loads((shard / "reference.json").read_text(encoding="utf-8")).items():
            if refs.setdefault(name, ref) != ref:
                raise SystemExit(f"{shard}: the full cache's {name} reference differs from another shard's")
    folder.save_references(refs)
    for key in [p.key for p in plan.pairs if p.key in rows]:
        preds = []
        for shard in sources[key]:
            preds += [p for x in (shard / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
                      if x.strip() and (p := json.loads(x)).get("key") == key]
        folder.append(rows[key], preds)
    missing = sorted(wanted - set(rows))
    print(f"{out}: {len(rows)} of {len(wanted)} pairs" + (f"; not run: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
