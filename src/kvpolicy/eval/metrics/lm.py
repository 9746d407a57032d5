"""``lm``: lm-evaluation-harness tasks under the reasoning protocol, per (policy, budget).

For each pair the tasks run through :class:`kvpolicy.eval.lmeval.KVPolicyLM` (lm-eval's own
``simple_evaluate``: its prompts, few-shot examples, chat template and filters), with ``n``
samples per problem (the task's ``repeats``). Each sample is then graded on its own:

- ``grader: math`` (the default for math tasks: gsm8k, minerva_math*, aime*, ...): math-verify
  compares the answer (after the reasoning trace) with the task's reference answer;
- ``grader: task``: the task's own scorer (its first metric, after its ``flexible-extract``
  filter when it has one, else its first filter) on that sample alone.

Reported per pair: pass@1 (mean correctness over all samples), pass@k (unbiased estimator, mean
over problems), mean generated tokens, the share that ended by themselves, the share ending in
a loop, the repeated 4-gram share, and the cost (output tokens/s at the batch size run, peak
memory, the most KV bytes a batch held, the share of time spent evicting; for a two-tier policy
its tiers: the most bytes the fast and slow tiers held, KiB moved from the slow tier per decoded
token, the recall hit rate); also per task, and lm-eval's own task metrics as
``harness/<task>/<metric>``. Every sample is recorded in
``samples.jsonl`` (the resume point) as it finishes; graded per-sample rows go to
``predictions.jsonl`` when the pair finishes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from .. import reasoning
from ..config import EvalConfig, EvalError, LMSettings
from .base import Column, Metric, MetricResult, mean, tier_columns

MATH_PREFIXES = ("gsm", "minerva_math", "hendrycks_math", "math", "aime", "amc", "hmmt", "olympiad", "mgsm",
                 "asdiv", "svamp")
SAMPLES_FILE = "samples.jsonl"


def is_math_task(name: str) -> bool:
    return name.lower().startswith(MATH_PREFIXES)


def _require_harness() -> None:
    missing = []
    for module in ("lm_eval", "math_verify", "datasets"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise EvalError(f"--lm-tasks needs {', '.join(missing)}: pip install 'kvpolicy[bench]'")


class LMTasks(Metric):
    """lm-eval tasks with n samples per problem: pass@1, pass@k, loops, cost (see the module)."""

    name: ClassVar[str] = "lm"
    help: ClassVar[str] = "lm-eval tasks (gsm8k, minerva_math500, aime25, ...): pass@1/pass@k, loops, tok/s, memory"
    needs_text: ClassVar[bool] = False

    def __init__(self, config: EvalConfig) -> None:
        super().__init__(config)
        s = config.lm
        passes = [Column(f"pass@{k}", f"pass@{k}", "{:.3f}", "higher", ranked=True) for k in s.pass_ks()]
        # Per instance, unlike other metrics: one pass@k column per k asked for.
        self.columns = passes + [  # type: ignore[misc]
            Column("gen_tokens", "tokens", "{:.0f}"),
            Column("ended", "ended", "{:.2f}", "higher"),
            Column("loop", "loop", "{:.2f}", "lower"),
            Column("lm_rep4", "rep4", "{:.3f}", "lower"),
            Column("lm_tok_s", "tok/s", "{:.1f}", "higher"),
            Column("lm_kv_mib", "KV MiB", "{:.1f}", "lower"),
            Column("lm_peak_mib", "peak MiB", "{:.0f}", "lower"),
            Column("evict_share", "evict %", "{:.1%}", "lower"),
            *tier_columns("lm_"),
        ]
        self._lm: Any = None

    # -- before the model loads ---------------------------------------------------------------
    def prepare(self, tokenizer, text, policies):
        s = self.config.lm
        if not s.tasks:
            raise EvalError("the lm metric needs tasks: --lm-tasks gsm8k minerva_math500 ... (or task YAML files)")
        bad = [k for k in s.pass_ks() if not 1 <= k <= s.samples]
        if bad:
            raise EvalError(f"pass@k needs 1 <= k <= samples ({s.samples}); got k = {bad} (raise --samples)")
        _require_harness()
        self.task_manager, self.tasks = load_tasks(s)

    # -- per pair -------------------------------------------------------------------------------
    def _model(self, ctx) -> Any:
        from ..lmeval import KVPolicyLM

        s = self.config.lm
        if self._lm is None:
            folder = getattr(ctx, "folder", None)
            self._lm = KVPolicyLM(
                ctx.config.model, model=ctx.model, tokenizer=ctx.tokenizer, batch_size=s.batch_size,
                max_gen_toks=s.max_new_tokens or 256, seed=self.config.seed, think_end_token=s.think_end,
                enable_thinking=s.enable_thinking, progress_every=s.progress_every if ctx.progress else -1,
                records=None if folder is None else str(Path(folder) / SAMPLES_FILE),
            )
            self._lm.base_attn = ctx.base_attn
        return self._lm

    def run(self, ctx, policy, reference):
        import lm_eval

        s = self.config.lm
        lm = self._model(ctx)
        lm.set_policy(policy)
        lm.cost.reset()
        seed = self.config.seed
        with _quiet("lm_eval", "lm-eval"):
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(self.tasks.values()), task_manager=self.task_manager,
                limit=_limit(s.limit), num_fewshot=s.num_fewshot, apply_chat_template=s.chat_template,
                system_instruction=s.system_instruction, gen_kwargs=gen_kwargs(s) or None, log_samples=True,
                bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        if results is None:  # pragma: no cover - only on non-zero ranks
            raise EvalError("lm-eval returned no results")
        return grade(results, self.tasks, lm, s)


def load_tasks(s: LMSettings) -> tuple[Any, dict[str, Any]]:
    """lm-eval's task manager and the tasks, loaded (data included) and set to ``s.samples`` repeats.

    Task YAML files alone skip indexing lm-eval's own ~10k task files (about 10 s)."""
    from lm_eval.tasks import TaskManager

    files = [t for t in s.tasks if t.endswith((".yaml", ".yml"))]
    for f in files:
        if not Path(f).is_file():
            raise EvalError(f"no such lm-eval task file: {f}")
    only_files = len(files) == len(s.tasks) and s.include_path is None
    if s.include_path is not None and not Path(s.include_path).is_dir():
        raise EvalError(f"lm.include_path {s.include_path} is not a folder")
    with _quiet("lm_eval", "lm-eval"):
        manager = TaskManager(include_path=s.include_path, include_defaults=not only_files)
    unknown = [t for t in s.tasks if t not in files and t not in manager.all_tasks]
    if unknown:
        hints = {t: [n for n in manager.all_subtasks if t.lower()[:4] in n.lower()][:5] for t in unknown}
        detail = "; ".join(f"{t!r} (similar: {', '.join(h) or 'none'})" for t, h in hints.items())
        raise EvalError(f"unknown lm-eval task(s): {detail}; list them with `lm-eval ls tasks`")
    try:
        with _quiet("lm_eval", "lm-eval"):
            loaded = manager.load(list(s.tasks))["tasks"]
    except Exception as exc:  # dataset download or parse failures, from datasets or lm-eval
        raise EvalError(
            f"cannot load lm-eval task(s) {', '.join(s.tasks)}: {type(exc).__name__}: {exc}. Task data comes from "
            "the Hugging Face Hub through `datasets`: pre-download it on a machine with internet access (into "
            "HF_HOME) and run with HF_DATASETS_OFFLINE=1, or point a task YAML at local files"
        ) from None
    for name, task in loaded.items():
        if task.get_config("output_type") != "generate_until":
            raise EvalError(f"lm-eval task {name!r} scores log-likelihoods ({task.get_config('output_type')}): the "
                            "reasoning protocol needs generative tasks; run it with kvpolicy-lm-eval instead")
        task.set_config(key="repeats", value=s.samples)
    return manager, loaded


def gen_kwargs(s: LMSettings) -> dict[str, Any]:
    """The generation settings that override the tasks' own."""
    out: dict[str, Any] = {}
    if s.temperature is not None:
        out["temperature"] = s.temperature
        out["do_sample"] = s.temperature > 0
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.max_new_tokens is not None:
        out["max_gen_toks"] = s.max_new_tokens
    return out


def _limit(limit: float | None) -> int | float | None:
    if limit is None:
        return None
    return limit if limit < 1 else int(limit)


class _quiet:
    """Raise the given loggers to ERROR for a block (lm-eval logs every step at INFO, and warns
    once per pair about the generation settings that the run itself set)."""

    def __init__(self, *names: str) -> None:
        self.loggers = [logging.getLogger(n) for n in names]
        self.levels: list[int] = []

    def __enter__(self) -> None:
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(max(lg.level, logging.ERROR))

    def __exit__(self, *exc: object) -> None:
        for lg, level in zip(self.loggers, self.levels, strict=True):
            lg.setLevel(level)


# -- grading --------------------------------------------------------------------------------------
def score_with_task(task: Any, doc: dict, response: str) -> float:
    """The task's own first metric on one response, after its ``flexible-extract`` filter (or its first).

    Uses lm-eval's filter pipelines (``task._filters``): lm-eval applies them to all of a
    problem's samples at once and keeps the first, so one sample is scored by running them on
    that sample alone.
    """
    ensembles = list(getattr(task, "_filters", []) or [])
    chosen = next((e for e in ensembles if e.name == "flexible-extract"), ensembles[0] if ensembles else None)
    filtered: Any = response
    if chosen is not None:
        resps: Any = [[response]]
        for make_filter in chosen.filters:
            resps = make_filter().apply(resps, [doc])
        filtered = list(resps)[0]
    scores = task.process_results(doc, [filtered])
    metric_list = task.get_config("metric_list") or []
    name = metric_list[0]["metric"] if metric_list else next(iter(scores))
    value = scores.get(name, next(iter(scores.values())))
    return float(value)


def _by_doc(samples: Iterable[dict]) -> dict[str, dict]:
    """lm-eval logs a problem once per filter: keep one entry per doc id."""
    out: dict[str, dict] = {}
    for entry in samples:
        out.setdefault(str(entry["doc_id"]), entry)
    return out


def grade(results: dict, tasks: dict[str, Any], lm: Any, s: LMSettings) -> MetricResult:
    """Grade every sample; summarise per task and over tasks (macro mean)."""
    records = {(r["task"], r["doc_id"], r["sample"]): r for r in lm.recorded()}
    values: dict[str, Any] = {}
    predictions: list[dict[str, Any]] = []
    per_task: dict[str, dict[str, float]] = {}
    all_samples: list[dict[str, Any]] = []
    for name, task in tasks.items():
        use_math = s.grader == "math" or (s.grader == "auto" and is_math_task(name))
        correct: dict[str, list[bool]] = defaultdict(list)
        rows = []
        for doc_id, entry in _by_doc(results.get("samples", {}).get(name, [])).items():
            responses = entry["resps"][0] if entry["resps"] else []
            for sample, response in enumerate(responses):
                response = response if isinstance(response, str) else str(response)
                if use_math:
                    try:
                        ok = reasoning.math_equal(response, entry["target"])
                    except ValueError as exc:
                        raise EvalError(f"task {name!r}, problem {doc_id}: {exc}; use --set lm.grader=task") from None
                else:
                    ok = score_with_task(task, entry["doc"], response) > 0
                correct[doc_id].append(ok)
                rec = records.get((name, doc_id, sample), {})
                row = {"task": name, "doc_id": doc_id, "sample": sample, "correct": ok,
                       "target": str(entry["target"])[-200:], "grader": "math-verify" if use_math else "task",
                       **{k: rec.get(k) for k in ("tokens", "finish", "ended", "thought_closed", "loop",
                                                  "loop_period", "loop_span", "rep4", "seconds")},
                       "response": response}
                rows.append(row)
        summary = _summary(correct, rows, s)
        per_task[name] = summary
        values.update({f"{k}/{name}": v for k, v in summary.items()})
        for key, value in (results.get("results", {}).get(name, {}) or {}).items():
            if "," in key and "stderr" not in key and isinstance(value, int | float):
                values[f"harness/{name}/{key}"] = float(value)
        predictions.extend(rows)
        all_samples.extend(rows)
    for k in s.pass_ks():
        values[f"pass@{k}"] = mean([t[f"pass@{k}"] for t in per_task.values() if f"pass@{k}" in t])
    values["gen_tokens"] = mean([r["tokens"] for r in all_samples if r["tokens"] is not None])
    values["ended"] = mean([float(bool(r["ended"])) for r in all_samples if r["ended"] is not None])
    values["loop"] = mean([float(bool(r["loop"])) for r in all_samples if r["loop"] is not None])
    values["lm_rep4"] = mean([r["rep4"] for r in all_samples if r["rep4"] is not None])
    values["samples"] = len(all_samples)
    cost = lm.cost.summary()
    values.update({"lm_tok_s": cost["tokens_per_s"], "lm_peak_mib": cost["peak_mib"], "lm_kv_mib": cost["kv_mib"],
                   "evict_share": cost["evict_share"], "lm_new_tokens": cost["new_tokens"],
                   "lm_decode_seconds": cost["seconds"], "batch_size": s.batch_size})
    tiers = lm.cost.total.tiers
    if tiers is not None:  # a two-tier policy
        values.update(tiers.values("lm_"))
    return MetricResult(values, predictions)


def _summary(correct: dict[str, list[bool]], rows: list[dict], s: LMSettings) -> dict[str, float]:
    out = {f"pass@{k}": reasoning.pass_at_k_mean(correct, k) for k in s.pass_ks()
           if all(len(v) >= k for v in correct.values())}
    out["loop"] = mean([float(bool(r["loop"])) for r in rows if r["loop"] is not None])
    out["ended"] = mean([float(bool(r["ended"])) for r in rows if r["ended"] is not None])
    return out
