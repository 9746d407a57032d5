"""``reconstruction``: how well the slots one eviction keeps reproduce each layer's attention output.

Keys, values and queries of a text are captured from one full-cache forward (:mod:`..capture`);
per layer, ``Policy.select`` chooses the slots to keep, and the relative error of the last
queries' attention output over the kept slots against all slots is averaged over layers.
"""

from __future__ import annotations

import math

import torch

from ...policy import Policy
from ..config import EvalError
from .base import Column, Metric, MetricResult, max_budget, mean, need_text


def attention_output(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal attention output ``[B, Hq, Q, Dv]`` of ``queries [B, Hq, Q, D]`` over ``keys``/``values``
    ``[B, Hkv, N, D]`` (grouped-query heads: head ``h`` reads KV head ``h // (Hq / Hkv)``).

    ``query_pos [Q]`` and ``key_pos [B, Hkv, N]`` are token positions: a query sees keys at or
    before its own position.
    """
    b, hq, q, d = queries.shape
    hkv = keys.shape[1]
    group = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    kp = key_pos.repeat_interleave(group, dim=1)  # [B, Hq, N]
    logits = queries.float() @ k.transpose(-1, -2) * scaling  # [B, Hq, Q, N]
    visible = kp[:, :, None, :] <= query_pos.view(1, 1, q, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius)."""
    denom = exact.float().norm()
    if float(denom) == 0.0:
        return 0.0 if float(approx.float().norm()) == 0.0 else math.inf
    return float((approx.float() - exact.float()).norm() / denom)


def reconstruction_error(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    scaling: float | None = None,
) -> float:
    """Relative error of the last ``Q`` queries' attention output over the ``kept [B, Hkv, K]`` slots
    (or a ``[B, Hkv, N]`` bool keep mask: heads keeping different counts) versus over all ``N``
    slots (slot ``i`` holds token ``i``; queries are the last ``Q`` tokens)."""
    b, hkv, n, _ = keys.shape
    q = queries.shape[2]
    qpos = torch.arange(n - q, n, device=keys.device)
    all_pos = torch.arange(n, device=keys.device).expand(b, hkv, n)
    exact = attention_output(queries, keys, values, qpos, all_pos, scaling)
    if kept.dtype == torch.bool:  # a dropped slot gets a position no query sees
        approx = attention_output(queries, keys, values, qpos, torch.where(kept, all_pos, n), scaling)
        return relative_error(approx, exact)
    gather = kept[..., None]
    k_kept = keys.gather(2, gather.expand(*kept.shape, keys.shape[-1]))
    v_kept = values.gather(2, gather.expand(*kept.shape, values.shape[-1]))
    approx = attention_output(queries, k_kept, v_kept, qpos, kept, scaling)
    return relative_error(approx, exact)


def kept_slots(
    policy: Policy, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: int = 0,
    budget: int | None = None,
) -> torch.Tensor:
    """The slots ``[B, Hkv, budget]`` one eviction of ``policy`` keeps of ``keys``/``values``
    ``[B, Hkv, N, D]``, given the captured ``queries [B, Hq, N, D]``; under an uneven allocation
    the ``[B, Hkv, N]`` keep mask of ``Policy.select_heads`` at the layer's ``budget``."""
    # The window goes to every policy that keeps one, as in the caches: a reservation can read it.
    w = policy.schedule.window
    if w > 0:
        window, valid = queries[:, :, -w:], None
    else:
        window = queries[:, :, -1:]
        valid = torch.zeros(queries.shape[0], 1, dtype=torch.bool, device=queries.device)
    if policy.allocation.uneven:
        keep, _ = policy.select_heads(keys, values, window, query_valid=valid, layer_idx=layer, budget=budget)
        return keep
    return policy.select(keys, values, window, query_valid=valid)


class Reconstruction(Metric):
    """Per-layer relative error of the last queries' attention output over the slots one eviction
    keeps (``Policy.select`` on captured keys/values/queries) versus over the full cache."""

    name = "reconstruction"
    help = "per-layer relative error of attention output over the kept slots vs the full cache"
    columns = [Column("recon_error", "recon err", "{:.4f}", "lower", ranked=True)]

    def prepare(self, tokenizer, text, policies):
        s = self.config.reconstruction
        if policies and s.tokens <= max_budget(policies):
            raise EvalError(
                f"reconstruction.tokens ({s.tokens}) must exceed the largest budget ({max_budget(policies)})"
            )
        need_text(text, s.tokens, "reconstruction")
        self.ids = text[: s.tokens]
        self._captured = None

    def _capture(self, ctx) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
        if self._captured is None:
            from ..capture import capture_attention

            self._captured = capture_attention(ctx.model, self.ids, ctx.device, ctx.base_attn)
        return self._captured

    def run(self, ctx, policy, reference):
        q_eval = self.config.reconstruction.queries
        layers = self._capture(ctx)
        errors = []
        schedules = None if policy is None else policy.layer_schedules(len(layers), layers[0][1].shape[1])
        for layer, (queries, keys, values, scaling) in enumerate(layers):
            if policy is None or schedules is None:
                kept = torch.arange(keys.shape[2], device=keys.device).expand(*keys.shape[:2], -1)
            else:
                kept = kept_slots(policy, queries, keys, values, layer, schedules[layer].budget)
            errors.append(reconstruction_error(queries[:, :, -q_eval:], keys, values, kept, scaling))
        return MetricResult({"recon_error": mean(errors), "recon_error_layers": errors})
