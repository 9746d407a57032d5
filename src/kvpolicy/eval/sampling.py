"""How the next token is chosen and when a row stops: the one sampling path of every decode.

**Sampling draws are per sample, not per batch.** Row ``r`` draws its token at step ``t`` by
inverse-CDF sampling with one uniform number that is a pure function of ``(key_r, t)``
(:func:`kvpolicy.seeds.uniform`, counter-based), ``key_r`` being the row's sample key
(``sample_key``). A sample therefore gets the same tokens in any batch, at any batch position,
on CPU or GPU (up to the logits' own float differences), and a resumed run regenerates exactly
the samples it lost. Greedy decoding (temperature 0) is ``argmax``.

Stop rules, per row (``StopRule``): an end-of-sequence token; a stop string in the *answer* (with
a ``think_end`` marker such as ``</think>``, stop strings are only looked for after it: a
reasoning trace may contain "Question:" or a blank line); ``max_new_tokens``. None applies
before ``min_new_tokens`` (throughput runs set it to ``max_new_tokens``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..seeds import combine, uniform

SAMPLE_STREAM = "kvpolicy.eval.sample"


@dataclass(frozen=True)
class SamplingParams:
    """How to decode: greedy when ``temperature`` is 0, else temperature / top-k / top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    think_end: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


def sample_key(*parts: object) -> int:
    """A stable signed 64-bit key from any printable parts (e.g. seed, task, doc id, sample)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def next_tokens(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, step: int) -> torch.Tensor:
    """The next token of each row, ``[B]`` long, from ``logits [B, V]``.

    Greedy: ``argmax``. Sampling: temperature, then top-k, then top-p (the smallest set of most
    likely tokens whose mass reaches ``top_p``), then inverse-CDF sampling with the uniform
    number ``uniform(combine(keys[r], step))`` of row ``r`` (``keys [B]`` long).
    """
    if not params.sampling:
        return logits.argmax(-1)
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
    if params.top_p < 1.0:
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    u = uniform(combine(keys.to(cdf.device), step), (1,), SAMPLE_STREAM).double() * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u).clamp_(max=vocab - 1)
    return order.gather(-1, pick).squeeze(-1)


@dataclass
class RowState:
    answer_from: int | None  # where the answer starts; None while a ``think_end`` marker is awaited


class StopRule:
    """Decides, after each new token, whether a row is done (see the module docstring).

    ``tokenizer`` decodes the last tokens to look for stop strings; it may be None when
    ``params`` has none.
    """

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(int(e) for e in eos_ids)
        self.params = params
        self.stop = tuple(s for s in params.stop if s)
        if self.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to be found in the generated tokens")
        longest = max((len(s) for s in (*self.stop, params.think_end or "")), default=0)
        self.window = longest + 8  # tokens: a string of c characters spans at most c tokens

    def new_state(self, thinking: bool) -> RowState:
        return RowState(None if thinking and self.params.think_end else 0)

    def __call__(self, tokens: list[int], state: RowState) -> str | None:
        """``"eos"``, ``"stop"`` or ``"length"`` once the row is done, else None."""
        n = len(tokens)
        p = self.params
        if n >= p.min_new_tokens:
            if tokens[-1] in self.eos:
                return "eos"
            if self.stop:
                if state.answer_from is None:
                    assert p.think_end is not None  # new_state only awaits a marker that is set
                    if p.think_end in self._tail(tokens, 0):
                        state.answer_from = n
                elif any(s in self._tail(tokens, state.answer_from) for s in self.stop):
                    return "stop"
        if n >= p.max_new_tokens:
            return "length"
        return None

    def _tail(self, tokens: list[int], start: int) -> str:
        return self.tokenizer.decode(tokens[max(start, len(tokens) - self.window) :], skip_special_tokens=False)
