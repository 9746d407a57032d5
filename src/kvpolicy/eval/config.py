"""The configuration of an evaluation run: what to compare, on what, with which metrics.

A run's ``config.yaml`` is this model dumped with every pair's policy resolved to a mapping
(``resolved_policies``), so ``kvpolicy eval --config runs/X/config.yaml`` and ``--resume runs/X``
repeat the run even if policy files change or move.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: The built-in policies, compared by default (plugins' policies can be named explicitly).
DEFAULT_POLICIES = [
    "snapkv",
    "rkv",
    "curdkv",
    "vase-dkv",
    "vase-attnv",
    "streamingllm",
    "evict-large-range",
    "random",
    # Selection (every token kept, a sparse subset attended at each step) at the same budgets.
    "oracle-topk",
    "quest",
    "vase-attnv@select",
]
DEFAULT_METRICS = ["perplexity", "fidelity", "passkey", "reconstruction", "speed"]

#: Names in ``policies`` that stand for a set of registered policies, resolved when the run is
#: planned, so a run configured with them stays complete as policies are added: ``builtin``, every
#: policy kvpolicy ships (eviction and selection); ``all``, those and every installed plugin's.
POLICY_SETS = ("builtin", "all")


#: The full-cache baseline's row: its key and policy name in the results.
FULL = "full"


def _default_policies() -> list[str | dict[str, Any]]:
    return list(DEFAULT_POLICIES)


class EvalError(ValueError):
    """Bad input to the harness, reported before any model work."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PerplexitySettings(_Section):
    tokens: int = Field(512, gt=1, description="Tokens of the text fed through the cache.")
    prefill: int = Field(64, gt=0, description="Tokens fed as the prompt (never evicted by default).")


class FidelitySettings(_Section):
    task: str = "gsm_symbolic"
    prompts: int = Field(2, gt=0)
    shots: int = Field(0, ge=0, description="Solved examples before the question (a longer prompt).")
    new_tokens: int = Field(64, gt=0, description="64 guarantees an eviction during generation.")
    budgets: list[int] | None = Field(
        None, description="The budgets this metric runs at (a subset of the run's; default: all of them).")
    free_running: bool = Field(
        True, description="Also generate freely under eviction (first divergence, repeated 4-grams: token by "
                          "token); false measures only the teacher-forced agreement, fed in exact chunks (fast).")


class PasskeySettings(_Section):
    samples: int = Field(3, gt=0, description="Passkeys per context length.")
    context: list[int] = Field(default_factory=lambda: [256], description="Total prompt tokens.")
    new_tokens: int = Field(8, gt=0)
    budgets: list[int] | None = Field(
        None, description="The budgets this metric runs at (a subset of the run's; default: all of them).")


class AccuracySettings(_Section):
    tasks: list[str] = Field(default_factory=lambda: ["gsm_symbolic", "chain_sum"])
    questions: int = Field(4, gt=0)
    samples: int = Field(2, gt=0, description="Samples per question (pass@1 is their mean).")
    max_new_tokens: int = Field(160, gt=0)
    temperature: float = Field(0.6, ge=0.0, description="0 means greedy.")


class ReconstructionSettings(_Section):
    tokens: int = Field(384, gt=1, description="Tokens of the text whose keys/values are captured.")
    queries: int = Field(64, gt=0, description="Most recent queries whose attention output is compared.")


class SpeedSettings(_Section):
    context: int = Field(256, gt=1, description="Tokens fed (chunked, evicting) before the timed decode.")
    new_tokens: int = Field(16, gt=0)
    batch: int = Field(1, gt=0, description="Rows decoded together (above 1: the prompt is the first `context` "
                                             "tokens of the text in every row, prefilled at once).")


class LMSettings(_Section):
    """lm-evaluation-harness tasks under the reasoning protocol (``--lm-tasks``): n samples per
    problem, pass@1 and pass@k, math-verify grading, per-sample loop signals and cost."""

    tasks: list[str] = Field(default_factory=list, description="lm-eval task names, or task YAML files.")
    include_path: str | None = Field(None, description="A folder of extra lm-eval task YAML files.")
    limit: float | None = Field(None, gt=0, description="Problems per task (a fraction if below 1).")
    samples: int = Field(1, gt=0, description="Samples per problem (n).")
    ks: list[int] = Field(default_factory=list, description="pass@k reported (default: 1 and n).")
    temperature: float | None = Field(None, ge=0.0, description="None: the task's own setting.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_new_tokens: int | None = Field(None, gt=0, description="The thinking budget (None: the task's).")
    batch_size: int = Field(1, gt=0)
    chat_template: bool = True
    enable_thinking: bool | None = Field(None, description="Passed to the chat template (Qwen3).")
    think_end: str = Field("auto", description="Reasoning-trace end marker: auto (</think> if known), none, or a string.")
    system_instruction: str | None = None
    num_fewshot: int | None = Field(None, ge=0)
    grader: Literal["auto", "math", "task"] = Field(
        "auto", description="math: math-verify; task: the task's own scorer; auto: math for math tasks.")
    progress_every: int = Field(10, ge=0, description="A progress line every N finished samples.")

    def pass_ks(self) -> list[int]:
        return sorted(set(self.ks or [1, self.samples]))


class EvalConfig(BaseModel):
    """Everything a run depends on; seeds make it reproducible."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "bundled", description='"bundled" (SmolLM2-135M GGUF), a model folder, a .gguf file or a Hub id (org/name).')
    device: str = "cpu"
    device_map: str | None = Field(None, description='e.g. "auto": spread the model over every GPU.')
    dtype: str = "float32"
    seed: int = 0
    budgets: list[int] = Field(default_factory=lambda: [96, 128])
    policies: list[str | dict[str, Any]] = Field(default_factory=_default_policies)
    metrics: list[str] = Field(default_factory=lambda: list(DEFAULT_METRICS))
    refusals: Literal["error", "report"] = Field(
        "error", description="A policy that refuses a budget (or the model's shape): error stops the run before "
                             "any work; report runs the rest and shows the pair as refused, with the reason.")
    text: str | None = Field(None, description="Long text file (default: reasoning-gym's in_the_year_2889.txt).")
    perplexity: PerplexitySettings = Field(default_factory=PerplexitySettings)
    fidelity: FidelitySettings = Field(default_factory=FidelitySettings)
    passkey: PasskeySettings = Field(default_factory=PasskeySettings)
    accuracy: AccuracySettings = Field(default_factory=AccuracySettings)
    reconstruction: ReconstructionSettings = Field(default_factory=ReconstructionSettings)
    speed: SpeedSettings = Field(default_factory=SpeedSettings)
    lm: LMSettings = Field(default_factory=LMSettings)
    resolved_policies: dict[str, dict[str, Any]] | None = Field(
        None, description="Written by a run into its config.yaml: each pair's policy (name@budget) as resolved when "
                          "the run started, or {refused: why}. When given, these are the pairs run (--resume, "
                          "--config), not the policies and budgets read again from names and files.")

    @field_validator("budgets")
    @classmethod
    def _positive_budgets(cls, v: list[int]) -> list[int]:
        if not v or any(b <= 0 for b in v):
            raise ValueError("budgets must be a non-empty list of positive integers")
        return sorted(set(v))

    @model_validator(mode="after")
    def _metric_budgets_are_run_budgets(self) -> EvalConfig:
        for section in ("passkey", "fidelity"):
            chosen = getattr(self, section).budgets
            if chosen is not None and (not chosen or set(chosen) - set(self.budgets)):
                raise ValueError(f"{section}.budgets {chosen} must be a non-empty subset of budgets {self.budgets}")
        return self

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {v!r}")
        return v

    # -- files -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> EvalConfig:
        path = Path(path)
        if not path.is_file():
            raise EvalError(f"no such configuration file: {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise EvalError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise EvalError(f"{path}: a configuration is a mapping, got {type(data).__name__}")
        data.pop("versions", None)  # written for the record, not inputs
        return cls.build(data, source=str(path))

    @classmethod
    def build(cls, data: dict[str, Any], source: str = "configuration") -> EvalConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
            )
            raise EvalError(f"invalid {source}: {problems}") from None

    def to_yaml(self, versions: dict[str, str] | None = None) -> str:
        data = self.model_dump(mode="json")
        if versions:
            data["versions"] = versions
        return yaml.safe_dump(data, sort_keys=False)


def apply_sets(data: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value read as YAML) to a configuration mapping."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise EvalError(f"--set expects SECTION.KEY=VALUE or KEY=VALUE, got {item!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        target = out
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise EvalError(f"--set {item!r}: {part!r} is not a section")
        target[parts[-1]] = value
    return out
