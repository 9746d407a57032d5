"""The metrics a run can select, each a small class with one job, in the ``METRICS`` registry.

A metric first ``prepare``s its inputs from the tokenizer (raising ``EvalError`` on bad input,
before the model is loaded), then ``run``s once with the full cache (``policy=None``; what it
returns as ``reference`` is handed to every later run) and once per (policy, budget) pair.
"""

from __future__ import annotations

import math
import platform
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..policy import Policy
from . import metrics as m
from .config import EvalConfig, EvalError
from .data import check_task, passkey_prompts, task_prompts
from .decoding import Stream


@dataclass(frozen=True)
class Column:
    """One reported number: its key in the results, table label, format and which way is better."""

    key: str
    label: str
    fmt: str = "{:.3f}"
    better: str = ""  # "higher", "lower" or "" (informational)

    def format(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return self.fmt.format(value)


@dataclass
class MetricResult:
    values: dict[str, Any]
    predictions: list[dict[str, Any]] = field(default_factory=list)
    reference: dict[str, Any] | None = None  # from the full-cache run, for the policy runs


@dataclass
class RunContext:
    """What the metrics share during a run."""

    config: EvalConfig
    model: Any
    tokenizer: Any
    device: str
    stop_ids: frozenset[int]
    base_attn: str = "sdpa"
    folder: Path | None = None  # the run folder (metrics that record per-sample files write there)
    progress: bool = True

    def stream(self, policy: Policy | None) -> Stream:
        return Stream(self.model, policy, self.base_attn)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class Metric:
    name: ClassVar[str]
    help: ClassVar[str]
    columns: ClassVar[list[Column]]
    needs_text: ClassVar[bool] = True  # reads the long text (the run then checks it is long enough)

    def __init__(self, config: EvalConfig) -> None:
        self.config = config

    def prepare(self, tokenizer, text: list[int], policies: list[Policy]) -> None:
        """Build the inputs; raise ``EvalError`` if they cannot measure ``policies``."""

    def run(self, ctx: RunContext, policy: Policy | None, reference: dict | None) -> MetricResult:
        raise NotImplementedError


def _need_text(text: list[int], n: int, what: str) -> None:
    if len(text) < n:
        raise EvalError(f"the text has {len(text)} tokens but {what} needs {n}: give a longer --text")


def _max_budget(policies: list[Policy]) -> int:
    return max((p.budget for p in policies), default=0)


# -- streaming perplexity ----------------------------------------------------------------------------
class Perplexity(Metric):
    """Perplexity of a long text fed through the cache in exact interval-aligned chunks."""

    name = "perplexity"
    help = "streaming perplexity of a long text under eviction, and its ratio to the full cache"
    columns = [
        Column("ppl", "PPL", "{:.2f}", "lower"),
        Column("ppl_ratio", "PPL / full", "{:.3f}", "lower"),
    ]

    def prepare(self, tokenizer, text, policies):
        s = self.config.perplexity
        if s.prefill >= s.tokens:
            raise EvalError(f"perplexity.prefill ({s.prefill}) must be below perplexity.tokens ({s.tokens})")
        if policies and s.tokens <= _max_budget(policies):
            raise EvalError(
                f"perplexity.tokens ({s.tokens}) must exceed the largest budget ({_max_budget(policies)}) "
                "or nothing is ever evicted"
            )
        _need_text(text, s.tokens, "perplexity")
        self.ids = text[: s.tokens]

    def run(self, ctx, policy, reference):
        s = self.config.perplexity
        stream = ctx.stream(policy)
        targets = torch.tensor(self.ids, device=ctx.device)
        nll = torch.zeros(len(self.ids) - 1)

        def collect(start: int, logits: torch.Tensor, base: int) -> None:
            # logits at text position p predict token p + 1
            pos = base + start
            stop = min(pos + logits.shape[0], len(self.ids) - 1)
            if stop > pos:
                nll[pos:stop] = m.token_nll(logits[: stop - pos], targets[pos + 1 : stop + 1]).cpu()

        stream.feed(self.ids[: s.prefill], lambda o, lg: collect(o, lg, 0))
        stream.feed(self.ids[s.prefill :], lambda o, lg: collect(o, lg, s.prefill))
        total = float(nll.sum())
        count = nll.numel()
        values = {"ppl": m.perplexity(total, count), "nll": total / count, "evictions": stream.evictions()}
        if reference is None:
            values["ppl_ratio"] = 1.0
            return MetricResult(values, reference={"nll": values["nll"]})
        values["ppl_ratio"] = math.exp(values["nll"] - reference["nll"])
        return MetricResult(values)


# -- generation fidelity -----------------------------------------------------------------------------
class Fidelity(Metric):
    """Greedy generation on reasoning-gym prompts against the full-cache run."""

    name = "fidelity"
    help = "greedy generation vs the full cache: token agreement, first divergence, repeated 4-grams"
    columns = [
        Column("agreement", "agree", "{:.3f}", "higher"),
        Column("first_divergence", "1st div", "{:.1f}", "higher"),
        Column("repeat_4gram", "rep4", "{:.3f}", "lower"),
    ]

    def prepare(self, tokenizer, text, policies):
        s = self.config.fidelity
        check_task(s.task)
        self.prompts, _ = task_prompts(tokenizer, s.task, s.prompts, self.config.seed, s.shots)

    def run(self, ctx, policy, reference):
        s = self.config.fidelity
        refs = reference["tokens"] if reference else None
        agreements, divergences, repeats, preds, generated = [], [], [], [], []
        for i, prompt in enumerate(self.prompts):
            stream = ctx.stream(policy)
            tokens, _ = stream.generate(stream.feed(prompt.ids), s.new_tokens, ctx.stop_ids)
            generated.append(tokens)
            ref = refs[i] if refs else tokens
            # Teacher-forced: the reference continuation fed through this cache (exact chunks);
            # how often would this cache have chosen the reference's next token?
            agreements.append(m.token_agreement(self._teacher_forced(ctx, policy, prompt.ids, ref), ref))
            divergences.append(m.first_divergence(tokens, ref))
            repeats.append(m.repeated_ngram_share(tokens, 4))
            preds.append(
                {
                    "task": prompt.task,
                    "index": prompt.index,
                    "prompt_tokens": len(prompt.ids),
                    "output": ctx.decode(tokens),
                    "agreement": agreements[-1],
                    "first_divergence": divergences[-1],
                    "repeat_4gram": repeats[-1],
                    "evictions": stream.evictions(),
                }
            )
        values = {
            "agreement": m.mean(agreements),
            "first_divergence": m.mean(divergences),
            "repeat_4gram": m.mean(repeats),
        }
        return MetricResult(values, preds, reference=None if reference else {"tokens": generated})

    @staticmethod
    def _teacher_forced(ctx, policy, prompt: list[int], ref: list[int]) -> list[int]:
        stream = ctx.stream(policy)
        first = stream.feed(prompt)
        predicted = [int(first.argmax())]
        if len(ref) > 1:
            out = torch.empty(len(ref) - 1, dtype=torch.long)
            stream.feed(ref[:-1], lambda o, lg: out.__setitem__(slice(o, o + lg.shape[0]), lg.argmax(-1).cpu()))
            predicted += out.tolist()
        return predicted


# -- passkey retrieval -------------------------------------------------------------------------------
class Passkey(Metric):
    """Passkey retrieval with the key in the prefill and the filler fed afterwards.

    Prefill never evicts (for most policies), so the key sits in the prompt and the filler and
    question are fed after it in exact chunks: they evict exactly as if the model had decoded
    them, and the key must survive every eviction to be retrieved.
    """

    name = "passkey"
    help = "passkey retrieval accuracy at context lengths above the budget (key early, filler decoded)"
    columns = [Column("passkey", "passkey", "{:.2f}", "higher")]

    def prepare(self, tokenizer, text, policies):
        s = self.config.passkey
        top = _max_budget(policies)
        for ctx_len in s.context:
            if policies and ctx_len <= top:
                raise EvalError(
                    f"passkey context {ctx_len} must exceed the largest budget ({top}) to test retrieval under eviction"
                )
        self.prompts = [p for c in s.context for p in passkey_prompts(tokenizer, c, s.samples, self.config.seed)]

    def run(self, ctx, policy, reference):
        s = self.config.passkey
        preds = []
        by_len: dict[int, list[float]] = {}
        for p in self.prompts:
            stream = ctx.stream(policy)
            stream.feed(p.prefix)
            tokens, _ = stream.generate(stream.feed(p.filler + p.suffix), s.new_tokens, ctx.stop_ids)
            text = ctx.decode(tokens)
            ok = m.passkey_correct(text, p.passkey)
            by_len.setdefault(p.context, []).append(float(ok))
            preds.append(
                {"passkey": p.passkey, "context": p.length, "output": text, "correct": ok, "evictions": stream.evictions()}
            )
        values = {"passkey": m.mean([x for v in by_len.values() for x in v])}
        values.update({f"passkey@{c}": m.mean(v) for c, v in by_len.items()})
        return MetricResult(values, preds)


# -- task accuracy -----------------------------------------------------------------------------------
class Accuracy(Metric):
    """pass@1 over ``samples`` samples per question, scored by the task's own reasoning-gym scorer."""

    name = "accuracy"
    help = "task accuracy (pass@1, reasoning-gym scorer) on e.g. gsm_symbolic, chain_sum"
    columns = [Column("accuracy", "pass@1", "{:.3f}", "higher")]

    def prepare(self, tokenizer, text, policies):
        s = self.config.accuracy
        for task in s.tasks:
            check_task(task)
        self.tasks = [task_prompts(tokenizer, t, s.questions, self.config.seed) for t in s.tasks]

    def run(self, ctx, policy, reference):
        from reasoning_gym.utils import extract_answer

        s = self.config.accuracy
        preds = []
        per_task: dict[str, list[float]] = {}
        for prompts, dataset in self.tasks:
            for prompt in prompts:
                for sample in range(s.samples):
                    g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + prompt.index * 1009 + sample)
                    stream = ctx.stream(policy)
                    tokens, _ = stream.generate(
                        stream.feed(prompt.ids), s.max_new_tokens, ctx.stop_ids, s.temperature, g
                    )
                    text = ctx.decode(tokens)
                    answer = extract_answer(text)
                    score = float(dataset.score_answer(answer, prompt.entry)) if answer is not None else 0.0
                    per_task.setdefault(prompt.task, []).append(float(score >= 1.0))
                    preds.append(
                        {"task": prompt.task, "index": prompt.index, "sample": sample, "answer": answer,
                         "expected": prompt.answer, "score": score, "output": text}
                    )
        values = {"accuracy": m.mean([x for v in per_task.values() for x in v])}
        values.update({f"accuracy/{t}": m.mean(v) for t, v in per_task.items()})
        return MetricResult(values, preds)


# -- attention reconstruction ------------------------------------------------------------------------
class Reconstruction(Metric):
    """Per-layer relative error of the last queries' attention output over the slots one eviction
    keeps (``Policy.select`` on captured keys/values/queries) versus over the full cache."""

    name = "reconstruction"
    help = "per-layer relative error of attention output over the kept slots vs the full cache"
    columns = [Column("recon_error", "recon err", "{:.4f}", "lower")]

    def prepare(self, tokenizer, text, policies):
        s = self.config.reconstruction
        if policies and s.tokens <= _max_budget(policies):
            raise EvalError(
                f"reconstruction.tokens ({s.tokens}) must exceed the largest budget ({_max_budget(policies)})"
            )
        _need_text(text, s.tokens, "reconstruction")
        self.ids = text[: s.tokens]
        self._captured = None

    def _capture(self, ctx) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        if self._captured is None:
            from .capture import capture_attention

            self._captured = capture_attention(ctx.model, self.ids, ctx.device, ctx.base_attn)
        return self._captured

    def run(self, ctx, policy, reference):
        q_eval = self.config.reconstruction.queries
        layers = self._capture(ctx)
        errors = []
        for queries, keys, values, scaling in layers:
            if policy is None:
                kept = torch.arange(keys.shape[2], device=keys.device).expand(*keys.shape[:2], -1)
            else:
                kept = _select(policy, queries, keys, values)
            errors.append(m.reconstruction_error(queries[:, :, -q_eval:], keys, values, kept, scaling))
        return MetricResult({"recon_error": m.mean(errors), "recon_error_layers": errors})


def _select(policy: Policy, queries, keys, values) -> torch.Tensor:
    # The window goes to every policy that keeps one, as in the caches: a reservation can read it.
    w = policy.schedule.window
    if w > 0:
        window, valid = queries[:, :, -w:], None
    else:
        window = queries[:, :, -1:]
        valid = torch.zeros(queries.shape[0], 1, dtype=torch.bool, device=queries.device)
    return policy.select(keys, values, window, query_valid=valid)


# -- speed and memory --------------------------------------------------------------------------------
class Speed(Metric):
    """Decode throughput once the cache is in steady state, peak memory and KV-cache bytes."""

    name = "speed"
    help = "decode tokens/s, peak memory (RSS on CPU, allocated on GPU) and KV-cache bytes"
    columns = [
        Column("tokens_per_s", "tok/s", "{:.1f}", "higher"),
        Column("kv_mib", "KV MiB", "{:.2f}", "lower"),
        Column("peak_mib", "peak MiB", "{:.0f}", "lower"),
    ]

    def prepare(self, tokenizer, text, policies):
        s = self.config.speed
        _need_text(text, s.context, "speed")
        self.ids = text[: s.context]

    def run(self, ctx, policy, reference):
        s = self.config.speed
        if s.batch > 1:
            return self._run_batched(ctx, policy)
        reset_peak_memory(ctx.device)
        stream = ctx.stream(policy)
        prefill = min(64, len(self.ids) - 1)
        stream.feed(self.ids[:prefill])
        logits = stream.feed(self.ids[prefill:])
        tokens, seconds = stream.generate(logits, s.new_tokens, frozenset())
        forwards = max(len(tokens) - 1, 1)
        values = {
            "tokens_per_s": forwards / seconds if seconds > 0 else float("nan"),
            "kv_mib": stream.memory_bytes() / 2**20,
            "peak_mib": peak_memory_mib(ctx.device),
        }
        return MetricResult(values)

    def _run_batched(self, ctx, policy):
        """``batch`` rows of the same prompt, prefilled at once, then ``new_tokens`` greedy steps each
        (no stopping): output tokens/s over the whole batch, as in the throughput setting."""
        from .generation import Prompt, SamplingParams, generate_batch

        s = self.config.speed
        reset_peak_memory(ctx.device)
        cache: Any
        if policy is None:
            from transformers import DynamicCache

            if ctx.model.config._attn_implementation != ctx.base_attn:
                ctx.model.set_attn_implementation(ctx.base_attn)
            cache = DynamicCache(config=ctx.model.config)
        else:
            from ..hf import KVPolicyCache

            cache = KVPolicyCache(policy, ctx.model, independent_rows=True)
        params = SamplingParams(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens)
        prompts = [Prompt(self.ids, key=r) for r in range(s.batch)]
        try:
            _, stats = generate_batch(ctx.model, cache, ctx.tokenizer, prompts, params, frozenset())
        except torch.cuda.OutOfMemoryError:
            # The full cache at long outputs: a finding, not a failure of the run.
            del cache
            torch.cuda.empty_cache()
            nan = float("nan")
            return MetricResult({"tokens_per_s": nan, "kv_mib": nan, "peak_mib": peak_memory_mib(ctx.device),
                                 "evict_share": None, "oom": True})
        decode = stats.seconds - stats.prefill_seconds
        steps = max(s.new_tokens - 1, 1)  # forwards after the prefill
        values = {
            "tokens_per_s": s.batch * steps / decode if decode > 0 else float("nan"),
            "kv_mib": stats.kv_bytes / 2**20,
            "peak_mib": peak_memory_mib(ctx.device),
            "evict_share": (stats.evict_seconds / decode) if stats.evict_seconds is not None and decode > 0 else None,
        }
        return MetricResult(values)


def reset_peak_memory(device: str) -> None:
    """Reset the peak-memory counter (CUDA allocator, or the process's VmHWM on Linux)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the whole process


def peak_memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if platform.system() == "Darwin" else peak / 1024


from .protocol import LMTasks  # noqa: E402  (it builds on the classes above)

METRICS: dict[str, type[Metric]] = {
    cls.name: cls for cls in (Perplexity, Fidelity, Passkey, Accuracy, Reconstruction, Speed, LMTasks)
}


def get_metrics(names: list[str], config: EvalConfig) -> list[Metric]:
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric(s) {', '.join(map(repr, unknown))}; available: {', '.join(METRICS)}")
    if not names:
        raise EvalError("no metric selected")
    return [METRICS[n](config) for n in dict.fromkeys(names)]
