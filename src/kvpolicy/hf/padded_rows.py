"""Does a left-padded row decode as it does alone? The check, with the model's kernels set apart.

kvpolicy promises that padding is never stored and never counts: given the same keys, values and
queries, a row of a padded batch keeps the same slots and attends to the same outputs as the row
alone. Whether ``generate()`` then gives the same *tokens* also depends on the model's own
kernels: a matrix product over a batch of 2 may round differently from one over a batch of 1 (on
CPU in bfloat16 this depends on the instruction set; on GPUs on the kernels chosen per shape), and
one rounding step in a logit can flip a top-k choice anywhere later.

``check_padded_rows`` therefore first measures the **full cache** (``DynamicCache``) on the same
model, dtype and prompts:

- a row whose tokens under the policy equal its tokens alone passes **end to end**;
- where they differ while the full cache is batch-invariant here (each padded row's logits equal
  the row alone's bit for bit at every step), the model's kernels cannot be the cause: it fails;
- where they do not, and the policy's tokens part, the model's kernels may be the cause, and the
  check tests kvpolicy's part instead (**replayed inputs**): it records the keys, values and
  queries each row's alone run gave the cache, replays them through a fresh cache as one
  left-padded batch (the padding filled with random values, which must not matter) and through
  a fresh cache row by row, and requires after every step the same kept slots holding
  bit-identical keys and values, and the same attention outputs up to the attention kernel's
  rounding over a different slot extent (``OUTPUT_TOLERANCE``).

The result of each row says which of the two it applied and why (``RowCheck.verdict``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from ..evicting import EvictingCache
from ..policy import Policy
from .cache import KVPolicyCache

END_TO_END = "end to end"
REPLAYED = "replayed inputs"


@dataclass(frozen=True)
class CacheCall:
    """One ``EvictingCache.attend`` call as the cache received it (tensors copied)."""

    layer: int
    queries: torch.Tensor  # [B, Hq, T, D]
    keys: torch.Tensor  # [B, Hkv, T, D]
    values: torch.Tensor  # [B, Hkv, T, Dv]
    token_valid: torch.Tensor | None  # [B, T] bool
    scaling: float | None


@dataclass(frozen=True)
class Mismatch:
    """Where a replayed padded row first departs from the same row replayed alone."""

    call: int  # index of the cache call (layers times steps, in the order the model made them)
    layer: int
    what: str  # "kept slots" or "attention outputs"

    def __str__(self) -> str:
        return f"{self.what} differ at call {self.call} (layer {self.layer})"


@dataclass(frozen=True)
class FullCacheRun:
    """How the full cache decodes one row in the padded batch against the row alone."""

    logits_from: int | None  # first generated token whose logits differ (None: identical throughout)
    tokens_from: int | None  # first generated token that differs (None: the same tokens)

    @property
    def batch_invariant(self) -> bool:
        return self.logits_from is None


@dataclass(frozen=True)
class RowCheck:
    """The padded-row check of one row: which comparison applied, and what it found."""

    row: int
    full_cache: FullCacheRun
    method: str  # END_TO_END or REPLAYED
    passed: bool
    first_difference: int | None  # a token (end to end) or a cache call (replayed), None if none
    detail: str

    @property
    def verdict(self) -> str:
        """One line for a report: the method, why it applied, and the outcome."""
        if self.method == END_TO_END:
            if self.passed:
                return "exact end to end"
            return f"FAIL end to end (full cache batch-invariant here; first differing token {self.first_difference})"
        parts = self.full_cache.tokens_from
        why = (f"parts at token {parts}" if parts is not None
               else f"logits differ from token {self.full_cache.logits_from}, tokens agree")
        head = f"full cache not batch-invariant here ({why}): kvpolicy's part"
        if self.passed:
            return f"{head} exact on replayed inputs"
        return f"{head} FAILS on replayed inputs ({self.detail})"


Generate = Callable[..., Any]


def check_padded_rows(
    model: Any,
    policy: Policy,
    ids: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
    *,
    make_cache: Callable[[Policy, Any], Any] | None = None,
    seed: int = 0,
) -> list[RowCheck]:
    """Check that every row of the left-padded batch ``ids`` ``[B, T]`` (``mask`` 1 for real
    tokens) decodes under ``policy`` as it does alone (module doc).

    Per row: the policy's tokens equal alone's: **end to end**, passed. They differ while the full
    cache is batch-invariant here (bit-identical logits at every step): failed, since the model's
    kernels cannot explain it. They differ where the full cache is not: the **replayed inputs**
    decide (``replay_padded``).

    Greedy decoding of exactly ``max_new_tokens`` tokens. ``make_cache(policy, model)`` builds the
    ``KVPolicyCache`` (default: ``KVPolicyCache(policy, model)``); ``seed`` seeds the padding's
    random filler in the replay. The model is left on the attention it had on entry.
    """
    build = make_cache or (lambda p, m: KVPolicyCache(p, m))
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be [B, T], got {tuple(ids.shape)} and {tuple(mask.shape)}")
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("check_padded_rows needs left padding: every row's last token must be real")
    attn = model.config._attn_implementation
    rows = range(ids.shape[0])
    real = [mask[r].bool() for r in rows]
    full = _full_cache_runs(model, ids, mask, max_new_tokens)
    try:
        batched = _generate(model, build(policy, model), ids, mask, max_new_tokens)
        alone_tokens, traces = [], []
        for r in rows:
            cache = build(policy, model)
            with record_calls(cache) as calls:
                alone_tokens.append(_generate(model, cache, ids[r : r + 1, real[r]], None, max_new_tokens))
            traces.append(calls)
    finally:
        model.set_attn_implementation(attn)
    parts = [_first_difference(batched[r, ids.shape[1]:], alone_tokens[r][0, int(real[r].sum()):]) for r in rows]
    replay: list[Mismatch | None] = [None] * len(rows)
    if any(p is not None and not f.batch_invariant for p, f in zip(parts, full, strict=True)):
        replay = replay_padded(policy, traces, num_kv_heads=_kv_heads(model), seed=seed)
    out = []
    for r in rows:
        if parts[r] is None:
            out.append(RowCheck(r, full[r], END_TO_END, True, None, "same tokens"))
        elif full[r].batch_invariant:
            out.append(RowCheck(r, full[r], END_TO_END, False, parts[r], f"tokens part at {parts[r]}"))
        else:
            m = replay[r]
            out.append(RowCheck(r, full[r], REPLAYED, m is None, None if m is None else m.call,
                                f"policy parts at token {parts[r]}; "
                                + ("same kept slots, keys, values and outputs" if m is None else str(m))))
    return out


@contextmanager
def record_calls(cache: Any) -> Iterator[list[CacheCall]]:
    """Record every ``attend`` call that ``cache`` (a ``KVPolicyCache``) passes to its
    ``EvictingCache`` while the block runs; yields the list it fills."""
    evicting = cache.evicting
    calls: list[CacheCall] = []
    attend = evicting.attend

    def recording(layer_idx, queries, keys, values, token_valid=None, *, scaling=None):
        calls.append(CacheCall(layer_idx, queries.clone(), keys.clone(), values.clone(),
                               None if token_valid is None else token_valid.clone(), scaling))
        return attend(layer_idx, queries, keys, values, token_valid, scaling=scaling)

    evicting.attend = recording  # this instance only, and only inside the block
    try:
        yield calls
    finally:
        del evicting.attend


def replay_padded(
    policy: Policy, traces: Sequence[Sequence[CacheCall]], *, num_kv_heads: int | None = None, seed: int = 0,
) -> list[Mismatch | None]:
    """Replay each row's recorded calls (``traces[r]``, recorded alone: batch 1, no padding)
    through a fresh ``EvictingCache`` row by row and through another as one batch, each call's
    chunk left-padded to the longest row's with random filler. After every call each row must
    hold the same slots (token positions, per KV head, in slot order) with bit-identical keys and
    values, and attend to the same outputs within the rounding of the attention kernel over a
    different slot extent (``OUTPUT_TOLERANCE``; the batch's extent is its fullest row's).

    Returns, per row, ``None`` where both agree throughout, else the first ``Mismatch``. Refuses
    traces that do not line up (different layers or steps).
    """
    if not traces or any(len(t) != len(traces[0]) for t in traces):
        raise ValueError(f"every row's trace must hold the same calls, got lengths {[len(t) for t in traces]}")
    for i, calls in enumerate(zip(*traces, strict=True)):
        if len({c.layer for c in calls}) != 1 or any(c.queries.shape[0] != 1 or c.token_valid is not None
                                                     for c in calls):
            raise ValueError(f"call {i}: rows' traces must be recorded alone (batch 1, no padding) on the same layer")
    num_layers = 1 + max(c.layer for c in traces[0])
    alone = [EvictingCache(policy, num_layers, num_kv_heads=num_kv_heads) for _ in traces]
    batch = EvictingCache(policy, num_layers, num_kv_heads=num_kv_heads)
    filler = torch.Generator().manual_seed(seed)
    found: list[Mismatch | None] = [None] * len(traces)
    for i, calls in enumerate(zip(*traces, strict=True)):
        layer, scaling = calls[0].layer, calls[0].scaling
        t = max(c.keys.shape[2] for c in calls)
        padded = [_left_pad(c, t, filler) for c in calls]
        valid = torch.stack([v for *_, v in padded]).to(calls[0].keys.device)
        out = batch.attend(
            layer, torch.cat([p[0] for p in padded]), torch.cat([p[1] for p in padded]),
            torch.cat([p[2] for p in padded]), None if bool(valid.all()) else valid, scaling=scaling,
        )
        held = _held(batch, layer)
        for r, c in enumerate(calls):
            want = alone[r].attend(layer, c.queries, c.keys, c.values, scaling=scaling)
            if found[r] is None:
                found[r] = _compare(i, layer, held[r], _held(alone[r], layer)[0], out[r : r + 1, :, t - c.keys.shape[2]:],
                                    want)
    return found


# Attention outputs of one row over the same slots, at the batch's slot extent and alone: SDPA's
# reductions run over every column, masked ones included, so they may round differently (seen:
# 4.5e-8 in float32, one bfloat16 ulp). A padded slot that leaked would differ by far more.
OUTPUT_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-3)}


def _compare(call: int, layer: int, got: tuple, want: tuple, got_out: torch.Tensor, want_out: torch.Tensor):
    for (name, a), b in zip((("kept slots", got[0]), ("held keys", got[1]), ("held values", got[2])),
                            want, strict=True):
        if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b, strict=True)):
            return Mismatch(call, layer, name)
    rtol, atol = OUTPUT_TOLERANCE.get(want_out.dtype, (0.0, 0.0))
    if not torch.allclose(got_out.float(), want_out.float(), rtol=rtol, atol=atol):
        return Mismatch(call, layer, "attention outputs")
    return None


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# -- internals -----------------------------------------------------------------------------------
def _full_cache_runs(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int) -> list[FullCacheRun]:
    batched = _generate(model, DynamicCache(config=model.config), ids, mask, n, logits=True)
    runs = []
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        alone = _generate(model, DynamicCache(config=model.config), ids[r : r + 1, keep], None, n, logits=True)
        differs = [i for i, (a, b) in enumerate(zip(batched.logits, alone.logits, strict=True))
                   if not torch.equal(a[r], b[0])]
        tokens = _first_difference(batched.sequences[r, ids.shape[1]:], alone.sequences[0, int(keep.sum()):])
        runs.append(FullCacheRun(differs[0] if differs else None, tokens))
    return runs


def _generate(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor | None, n: int, logits: bool = False):
    """Greedy generation of exactly ``n`` tokens through ``cache`` (its logits too, if asked)."""
    # generate() names the cache argument `cache` from transformers 5.24 on, `past_key_values` before.
    kw = "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, return_dict_in_generate=logits, output_logits=logits, **{kw: cache},
        )
    return out


def _kv_heads(model: Any) -> int | None:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)


def _left_pad(call: CacheCall, t: int, filler: torch.Generator):
    """The call's tensors left-padded to ``t`` tokens with random values, and its ``[t]`` validity."""
    pad = t - call.keys.shape[2]

    def widen(x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn((*x.shape[:2], pad, x.shape[3]), generator=filler).to(x.device, x.dtype)
        return torch.cat([noise, x], dim=2)

    valid = torch.arange(t) >= pad
    return widen(call.queries), widen(call.keys), widen(call.values), valid


def _held(cache: EvictingCache, layer: int) -> list[tuple[list, list, list]]:
    """Per row: per KV head, the token positions held (slot order), their keys and their values."""
    view = cache.layers[layer]
    positions, valid, keys, values = view.positions.cpu(), view.valid.cpu(), view.keys.cpu(), view.values.cpu()
    heads = range(positions.shape[1])
    return [([positions[r, h][valid[r, h]].tolist() for h in heads], [keys[r, h][valid[r, h]] for h in heads],
             [values[r, h][valid[r, h]] for h in heads]) for r in range(positions.shape[0])]


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])
