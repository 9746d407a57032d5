"""Running an evaluation: validate everything, then the full cache, then each (policy, budget).

Results are appended to the run folder as each pair finishes (``results.jsonl``,
``predictions.jsonl``, ``metrics.json`` rewritten), so an interrupted run keeps every finished
pair and ``resume`` picks up the rest.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..config import PolicyError
from ..files import replace_file
from ..loading import load_policy
from ..policy import Policy
from .config import FULL, POLICY_SETS, EvalConfig, EvalError
from .decoding import stop_token_ids
from .metrics import Column, Metric, RunContext, get_metrics
from .models import (
    ModelSource,
    attention_kernels,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from .progress import PairEta
from .records import set_aside, warn_damaged
from .report import progress_bar, ranking_markdown, shown_columns, write_plots


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: every finished pair is saved in ``folder``; resume it from there."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.folder = folder


@dataclass
class Pair:
    """One row of the comparison: a policy at a budget, or the full cache (``policy`` None)."""

    name: str
    budget: int | None
    policy: Policy | None
    refused: str | None = None  # why the policy cannot run at this budget (``refusals: report``)

    @property
    def key(self) -> str:
        return FULL if self.budget is None else f"{self.name}@{self.budget}"

    @property
    def kind(self) -> str:
        """``"full"``, or the policy's mode: ``"evict"`` or ``"select"`` (which costs more)."""
        return FULL if self.policy is None else self.policy.mode


@dataclass
class Plan:
    """A validated run: everything checked and tokenized, nothing loaded but the tokenizer."""

    config: EvalConfig
    source: ModelSource
    device: str
    tokenizer: Any
    metrics: list[Metric]
    pairs: list[Pair]
    text_name: str
    resolved: dict[str, dict] = field(default_factory=dict)
    attention: dict[str, str] | None = None  # the kernels that ran (known once the model is loaded)

    @property
    def columns(self) -> list[Column]:
        """The reported numbers, metric by metric (the table's columns, one plot each)."""
        return [c for metric in self.metrics for c in metric.columns]


def expand_policies(specs: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
    """``specs`` with the set names of ``POLICY_SETS`` replaced by the policies registered now:
    ``builtin`` by kvpolicy's own, ``all`` by every registered one (installed plugins' too), in
    name order; a policy named twice is kept once, where it first appears."""
    from ..registry import get_registry

    registered = get_registry().policies
    out: list[str | dict[str, Any]] = []
    for spec in specs:
        if isinstance(spec, str) and spec in POLICY_SETS:
            out += sorted(n for n, r in registered.items() if spec == "all" or r.plugin == "kvpolicy")
        else:
            out.append(spec)
    seen: set[str] = set()
    unique = []
    for spec in out:
        if isinstance(spec, str):
            if spec in seen:
                continue
            seen.add(spec)
        unique.append(spec)
    return unique


def resolve_policies(config: EvalConfig) -> list[Pair]:
    """Every (policy, budget) pair, loaded and validated. A budget too small for a policy is an
    error here, or with ``refusals: report`` a refused pair that the run shows and skips. A saved
    run's configuration gives its pairs as resolved then (``resolved_policies``)."""
    if config.resolved_policies is not None:
        return [_saved_pair(key, entry) for key, entry in config.resolved_policies.items()]
    pairs = []
    for budget in config.budgets:
        for spec in expand_policies(config.policies):
            label = spec if isinstance(spec, str) else spec.get("name", "<mapping>")
            try:
                policy = load_policy(spec, budget=budget)
            except PolicyError as exc:
                if config.refusals == "report":
                    pairs.append(Pair(_policy_name(spec), budget, None, refused=str(exc)))
                    continue
                raise EvalError(f"policy {label!r} at budget {budget}: {exc}") from None
            except Exception as exc:  # unknown stage types from plugins, unreadable files
                raise EvalError(f"policy {label!r}: {exc}") from None
            pairs.append(Pair(policy.name, budget, policy))
    keys = [p.key for p in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise EvalError(f"two policies share a name: {', '.join(dupes)} (set a distinct 'name' in each file)")
    return pairs


def _saved_pair(key: str, entry: dict[str, Any]) -> Pair:
    """The pair ``key`` (``name@budget``) of ``resolved_policies``: its policy as resolved when the
    run started, or its refusal."""
    name, _, budget = key.rpartition("@")
    if not budget.isdigit():
        raise EvalError(f"resolved_policies: {key!r} is not name@budget")
    if "refused" in entry:
        return Pair(name, int(budget), None, refused=str(entry["refused"]))
    try:
        policy = load_policy(entry)
    except Exception as exc:  # PolicyError, or a plugin's stage no longer installed
        raise EvalError(f"resolved_policies: {key!r} no longer loads: {exc}") from None
    if f"{policy.name}@{policy.budget}" != key:
        raise EvalError(f"resolved_policies: {key!r} holds the policy {policy.name}@{policy.budget}")
    return Pair(policy.name, policy.budget, policy)


def _policy_name(spec: str | dict[str, Any]) -> str:
    """The name a policy's rows carry, read without loading it (for a refused one)."""
    if isinstance(spec, dict):
        return str(spec.get("name", "<mapping>"))
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict) and data.get("name"):
            return str(data["name"])
        return path.stem
    return spec


def plan_run(config: EvalConfig) -> Plan:
    """Check every input (model, policies, budgets, metrics, tasks, text lengths) before model work."""
    from .data import read_text, text_ids

    metrics = get_metrics(config.metrics, config)
    pairs = resolve_policies(config)
    source = resolve_model(config.model)
    device = resolve_device(config.device) if not config.device_map else "cuda"
    tokenizer = load_tokenizer(source)
    policies = [p.policy for p in pairs if p.policy is not None]  # every pair here has one
    ids: list[int] = []
    text_name = "-"
    if any(m.needs_text for m in metrics):
        text, text_name = read_text(config.text)
        ids = text_ids(tokenizer, text)
        if policies and len(ids) <= max(p.budget for p in policies):
            raise EvalError(f"the text {text_name} has {len(ids)} tokens, not more than the largest budget")
    for metric in metrics:
        metric.prepare(tokenizer, ids, [p for p in policies if metric.runs_at(p.budget)])
    resolved = {p.key: {"refused": p.refused} if p.policy is None else p.policy.config.to_dict() for p in pairs}
    resolved = json.loads(json.dumps(resolved, default=str))  # plain YAML types only
    return Plan(config, source, device, tokenizer, metrics, [Pair(FULL, None, None), *pairs], text_name, resolved)


def refused_row(pair: Pair, reason: str) -> dict:
    """The row of a pair whose policy refused its budget or the model: no values, the reason."""
    return {"key": pair.key, "policy": pair.name, "budget": pair.budget, "values": {}, "refused": reason,
            "seconds": 0.0}


def versions() -> dict[str, str]:
    import torch
    import transformers

    from .. import __version__

    out = {"kvpolicy": str(__version__), "torch": str(torch.__version__),
           "transformers": str(transformers.__version__), "python": platform.python_version()}
    from importlib.metadata import PackageNotFoundError, version

    for key, dist in (("reasoning_gym", "reasoning-gym"), ("lm_eval", "lm-eval"), ("math_verify", "math-verify")):
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            pass
    return out


class RunFolder:
    """The files of one run; every write leaves the folder consistent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results_file = path / "results.jsonl"
        self.predictions_file = path / "predictions.jsonl"
        self.reference_file = path / "reference.json"

    @staticmethod
    def new(root: str | Path | None) -> RunFolder:
        if root is None:
            root = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(root)
        if path.exists() and any(path.iterdir()):
            raise EvalError(f"run folder {path} is not empty (use --resume {path} to continue it)")
        path.mkdir(parents=True, exist_ok=True)
        return RunFolder(path)

    def write_config(self, plan: Plan) -> None:
        config = plan.config.model_copy(update={"resolved_policies": plan.resolved})
        (self.path / "config.yaml").write_text(config.to_yaml(versions()), encoding="utf-8")

    def finished(self) -> dict[str, dict]:
        """The rows of the finished pairs. A line that is not a row is an ``EvalError`` naming it:
        it stands for a pair's work, so the user decides (mend it, or delete it to run the pair again)."""
        rows = {}
        if self.results_file.is_file():
            for n, raw in enumerate(self.results_file.read_bytes().split(b"\n"), start=1):
                if not raw.strip():
                    continue
                row, why = _json_object(raw, needs={"key": str, "values": dict})
                if row is None:
                    raise EvalError(
                        f"{self.results_file}: line {n} is not a finished pair's row ({why}): "
                        f"{raw[:80].decode('utf-8', errors='replace')!r}; mend the line, or delete it to run "
                        "that pair again (a run killed while writing it leaves it cut short)")
                rows[row["key"]] = row
        return rows

    def drop_unfinished_predictions(self, done: set[str]) -> None:
        """Keep the predictions of the finished pairs; a line that is not a prediction (a hand
        edit, a line cut short) is moved to ``predictions.jsonl.damaged`` with a warning."""
        if not self.predictions_file.is_file():
            return
        kept, damaged = [], []
        for n, raw in enumerate(self.predictions_file.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            pred, why = _json_object(raw, needs={"key": str})
            if pred is None:
                damaged.append((n, raw, f"not a prediction: {why}"))
            elif pred["key"] in done:
                kept.append(raw + b"\n")
        if damaged:
            warn_damaged(self.predictions_file, damaged, set_aside(self.predictions_file, damaged))
        replace_file(self.predictions_file, b"".join(kept))

    def references(self) -> dict[str, dict]:
        """The full cache's references (``reference.json``); damaged, an ``EvalError`` naming it."""
        if not self.reference_file.is_file():
            return {}
        refs, why = _json_object(self.reference_file.read_bytes(), needs={})
        if refs is None:
            raise EvalError(f"{self.reference_file} is damaged ({why}); delete it and --resume computes the "
                            "full cache's references again")
        return refs

    def save_references(self, refs: dict[str, dict]) -> None:
        replace_file(self.reference_file, json.dumps(refs).encode("utf-8"))  # whole, or the old file

    def append(self, row: dict, predictions: list[dict]) -> None:
        with self.predictions_file.open("a", encoding="utf-8") as f:
            for p in predictions:
                f.write(json.dumps(p, default=str) + "\n")
        with self.results_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=_json_default) + "\n")

    def write_summary(self, plan: Plan, rows: list[dict]) -> Path:
        summary = {
            "model": plan.source.name,
            "text": plan.text_name,
            "device": plan.device,
            "device_map": plan.config.device_map,
            "attention": plan.attention,
            "budgets": plan.config.budgets,
            "metrics": plan.config.metrics,
            "seed": plan.config.seed,
            "versions": versions(),
            "columns": [
                {"key": c.key, "label": c.label, "better": c.better, "metric": metric.name}
                for metric in plan.metrics
                for c in shown_columns(metric.columns, rows)
            ],
            "rows": rows,
        }
        out = self.path / "metrics.json"
        out.write_text(json.dumps(summary, indent=2, default=_json_default), encoding="utf-8")
        return out


def _json_default(x: Any) -> Any:
    return str(x)


def _json_object(raw: bytes, needs: dict[str, type]) -> tuple[dict | None, str]:
    """The JSON object in ``raw`` with the fields ``needs`` of their types, and ""; else None and why not."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return None, f"not JSON: {exc}"
    if not isinstance(obj, dict):
        return None, f"JSON {type(obj).__name__}, not an object"
    wrong = [name for name, kind in needs.items() if not isinstance(obj.get(name), kind)]
    if wrong:
        return None, f"no {', '.join(wrong)} of the right type"
    return obj, ""


@dataclass
class RunResult:
    folder: Path
    rows: list[dict]
    plan: Plan
    plots: list[Path] = field(default_factory=list)


def run_eval(
    config: EvalConfig | None,
    out: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    console=None,
    progress: bool = True,
    report_only: bool = False,
) -> RunResult:
    """Run (or resume) an evaluation; return the run folder and its rows.

    ``config`` is None only with ``resume``: the run folder's own ``config.yaml`` is used.
    ``report_only`` (with ``resume``) runs nothing: it writes the summary, tables and plots of
    the pairs the folder has finished (a partial run, or folders merged by hand).
    """
    import torch
    from rich.console import Console

    console = console or Console(stderr=True)
    if resume is not None:
        folder = RunFolder(Path(resume))
        config = EvalConfig.load(folder.path / "config.yaml")
    elif config is None:
        raise EvalError("run_eval needs a config, unless it resumes a run")
    plan = plan_run(config)  # every input checked before the model is loaded
    if resume is None:
        folder = RunFolder.new(out)
        folder.write_config(plan)
    done = folder.finished()
    folder.drop_unfinished_predictions(set(done))
    refs = folder.references()
    todo = [p for p in plan.pairs if p.key not in done or (p.policy is None and not _has_refs(plan, refs))]
    if report_only:
        if resume is None:
            raise EvalError("report_only writes the report of an existing run folder: give resume")
        todo = []
    console.print(f"[bold]kvpolicy eval[/bold]: {plan.source.name} on {plan.device}, "
                  f"{len(plan.pairs) - 1} policy x budget pairs + full cache, metrics {', '.join(plan.config.metrics)}")
    console.print(f"run folder: {folder.path}" + (f" (resuming: {len(done)} pair(s) done)" if done else ""))

    rows = {k: v for k, v in done.items()}
    for pair in [p for p in todo if p.refused is not None]:  # refused before any work: shown, not run
        row = refused_row(pair, pair.refused or "")
        folder.append(row, [])
        rows[pair.key] = row
        console.print(f"refused: {pair.key}: {pair.refused}", highlight=False)
    todo = [p for p in todo if p.refused is None]
    if todo:
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        dtype = resolve_dtype(config.dtype, plan.device)
        model = load_model(plan.source, dtype, plan.device, device_map=config.device_map)
        kernels = attention_kernels(model)
        console.print(f"model loaded in {time.perf_counter() - t0:.1f} s ({dtype}); attention: full cache "
                      f"{kernels['full']}, kvpolicy {kernels['kvpolicy']}", highlight=False)
        ctx = RunContext(config, model, plan.tokenizer, plan.device, stop_token_ids(plan.tokenizer, model),
                         base_attn=model.config._attn_implementation, folder=folder.path, progress=progress)
        plan.attention = kernels
        eta = PairEta([(p.key, p.name, p.kind) for p in todo])
        try:
            with progress_bar(console, enabled=progress) as bar:
                task = bar.add_task("pairs", total=len(todo))
                for pair in todo:
                    bar.update(task, description=f"{pair.key}")
                    started = time.perf_counter()
                    try:
                        row, preds = _run_pair(ctx, plan, pair, refs, bar)
                    except PolicyError as exc:  # the policy refuses this model (e.g. a head profile's shape)
                        if pair.policy is None or config.refusals != "report":
                            raise EvalError(f"policy {pair.key!r}: {exc}") from None
                        row, preds = refused_row(pair, str(exc)), []
                        console.print(f"refused: {pair.key}: {exc}", highlight=False)
                    eta.done(pair.key, time.perf_counter() - started)
                    if pair.policy is None:
                        folder.save_references(refs)
                    if pair.key not in done:
                        folder.append(row, preds)
                        rows[pair.key] = row
                        folder.write_summary(plan, _ordered(plan, rows))
                    bar.update(task, eta=eta.text())
                    bar.advance(task)
        except KeyboardInterrupt:
            raise RunInterrupted(folder.path) from None
    ordered = _ordered(plan, rows)
    folder.write_summary(plan, ordered)
    plots = write_plots(folder.path / "plots", plan.columns, ordered)
    ranked = ranking_markdown(plan.columns, ordered)
    if ranked:
        (folder.path / "ranking.md").write_text(ranked, encoding="utf-8")
    return RunResult(folder.path, ordered, plan, plots)


def _has_refs(plan: Plan, refs: dict) -> bool:
    return all(m.name in refs for m in plan.metrics if m.needs_reference)


def _run_pair(ctx: RunContext, plan: Plan, pair: Pair, refs: dict, bar) -> tuple[dict, list[dict]]:
    start = time.perf_counter()
    values: dict[str, Any] = {}
    predictions = []
    sub = bar.add_task(f"  {pair.key}", total=len(plan.metrics))
    try:
        if pair.policy is not None:  # a policy bound to another model's shape refuses here, before any work
            pair.policy.layer_schedules(*_model_shape(ctx.model))
        for metric in plan.metrics:
            bar.update(sub, description=f"  {metric.name}")
            if not metric.runs_at(pair.budget):
                bar.advance(sub)
                continue
            result = metric.run(ctx, pair.policy, None if pair.policy is None else refs.get(metric.name))
            if pair.policy is None and result.reference is not None:
                refs[metric.name] = result.reference
            values.update(result.values)
            for p in result.predictions:
                predictions.append({"key": pair.key, "policy": pair.name, "budget": pair.budget,
                                    "metric": metric.name, **p})
            bar.advance(sub)
    finally:
        bar.remove_task(sub)
    row = {"key": pair.key, "policy": pair.name, "budget": pair.budget, "mode": pair.kind, "values": values,
           "seconds": round(time.perf_counter() - start, 2)}
    return row, predictions


def _model_shape(model: Any) -> tuple[int, int]:
    """``(layers, KV heads)`` of a transformers decoder, as a cache for it sees them."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layers = int(cfg.num_hidden_layers)
    return layers, int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def _ordered(plan: Plan, rows: dict[str, dict]) -> list[dict]:
    return [rows[p.key] for p in plan.pairs if p.key in rows]
