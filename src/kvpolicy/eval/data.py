"""Inputs of the metrics: a long text, reasoning-gym prompts and passkey prompts, as token ids."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from .config import EvalError

DEFAULT_TEXT = "in_the_year_2889.txt"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_MARK = "\u0000SPLIT\u0000"


# -- the long text --------------------------------------------------------------------------------
def read_text(path: str | None) -> tuple[str, str]:
    """The text and its display name (default: reasoning-gym's ``in_the_year_2889.txt``)."""
    if path is None:
        try:
            source = files("reasoning_gym") / "data" / DEFAULT_TEXT
            return source.read_text(encoding="utf-8"), f"reasoning_gym/data/{DEFAULT_TEXT}"
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise EvalError(f"the default text needs reasoning-gym: pip install reasoning-gym ({exc})") from None
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"no such text file: {p}")
    return p.read_text(encoding="utf-8"), str(p)


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- reasoning-gym tasks ---------------------------------------------------------------------------
@dataclass
class TaskPrompt:
    task: str
    index: int
    question: str
    answer: str
    entry: dict[str, Any] = field(repr=False)
    ids: list[int] = field(repr=False, default_factory=list)


def check_task(task: str) -> None:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise EvalError(f"task metrics need reasoning-gym: pip install reasoning-gym ({exc})") from None
    if task not in DATASETS:
        known = ", ".join(sorted(DATASETS)[:12])
        raise EvalError(f"unknown task {task!r}; reasoning-gym tasks include: {known}, ...")


def make_dataset(task: str, size: int, seed: int):
    import reasoning_gym

    check_task(task)
    return reasoning_gym.create_dataset(task, size=size, seed=seed)


def system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def chat_ids(tokenizer, messages: list[dict[str, str]], assistant_prefix: str = "") -> list[int]:
    """Token ids of a chat prompt ending where the assistant speaks (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return text_ids(tokenizer, text + assistant_prefix)


def task_prompts(tokenizer, task: str, n: int, seed: int, shots: int = 0) -> tuple[list[TaskPrompt], Any]:
    """``n`` seeded questions of ``task`` as chat prompts, each after ``shots`` solved examples.

    Returns the prompts and the dataset (whose ``score_answer`` scores them).
    """
    dataset = make_dataset(task, n + shots, seed)
    entries = [dataset[i] for i in range(n + shots)]
    examples, questions = entries[:shots], entries[shots:]
    prompts = []
    for i, entry in enumerate(questions):
        messages = [{"role": "system", "content": system_prompt()}]
        for ex in examples:
            messages.append({"role": "user", "content": ex["question"]})
            messages.append({"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"})
        messages.append({"role": "user", "content": entry["question"]})
        prompts.append(
            TaskPrompt(task, i, entry["question"], str(entry["answer"]), entry, chat_ids(tokenizer, messages))
        )
    return prompts, dataset


# -- passkey retrieval -----------------------------------------------------------------------------
@dataclass
class PasskeyPrompt:
    """A passkey prompt in three parts: ``prefix`` (holds the key; the prefill), ``filler`` and
    ``suffix`` (the question; fed after the prefill, so they evict like decoded tokens)."""

    passkey: str
    context: int
    prefix: list[int] = field(repr=False)
    filler: list[int] = field(repr=False)
    suffix: list[int] = field(repr=False)

    @property
    def length(self) -> int:
        return len(self.prefix) + len(self.filler) + len(self.suffix)


def passkey_prompts(tokenizer, context: int, samples: int, seed: int) -> list[PasskeyPrompt]:
    """``samples`` prompts of about ``context`` tokens with a 5-digit key at the very start."""
    rng = random.Random(f"passkey-{seed}-{context}")
    intro = (
        "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about it."
    )
    out = []
    for _ in range(samples):
        key = str(rng.randint(10000, 99999))
        statement = f"The pass key is {key}. Remember it. {key} is the pass key."
        question = "What is the pass key?"
        content = f"{intro} {statement} {_MARK}{question}"
        messages = [{"role": "user", "content": content}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"user: {content}\nassistant: "
        head, tail = text.split(_MARK)
        prefix = text_ids(tokenizer, head)
        suffix = text_ids(tokenizer, tail + "The pass key is")
        room = context - len(prefix) - len(suffix)
        if room <= 0:
            raise EvalError(f"passkey context {context} is shorter than the prompt without filler")
        unit = text_ids(tokenizer, FILLER)
        filler = (unit * (room // len(unit) + 1))[:room]
        out.append(PasskeyPrompt(key, context, prefix, filler, suffix))
    return out
