"""Attention importance over a window of recent queries (SnapKV family)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from .base import EvictionInput, Scorer


class AttentionScorer(Scorer):
    """How much the last ``W`` queries attend to each candidate slot.

    ``logits = Q K_cand^T / sqrt(D)`` over candidate keys only, softmax over candidates in float32,
    reduced over the window (``window_reduce``) and over the ``G`` query heads of a KV head
    (``group_reduce``, either on the probabilities after softmax or on the raw logits before it),
    then smoothed along the token axis (``pooling`` with ``kernel``, stride 1, zero padding).

    VaSE / SnapKV decode: ``group_reduce=mean, group_reduce_at=after_softmax, window_reduce=mean,
    pooling=avg, kernel=5``. Official R-KV: ``group_reduce=max, group_reduce_at=before_softmax,
    pooling=max, kernel=7``.
    """

    type_name: ClassVar[str] = "attention"

    pooling: Literal["none", "avg", "max"] = "avg"
    kernel: int = Field(5, ge=1, description="Pooling kernel (odd), stride 1, padding kernel // 2.")
    group_reduce: Literal["mean", "max"] = "mean"
    group_reduce_at: Literal["after_softmax", "before_softmax"] = "after_softmax"
    window_reduce: Literal["mean", "sum"] = "mean"

    @model_validator(mode="after")
    def _odd_kernel(self) -> AttentionScorer:
        if self.pooling != "none" and self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd so the pooled scores stay aligned, got {self.kernel}")
        return self

    def validate_schedule(self, schedule) -> None:
        if schedule.window < 1:
            raise ValueError("the attention scorer needs a window of at least one query")

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, d = inp.keys.shape
        c, g, w = inp.num_candidates, inp.group_size, inp.queries.shape[2]
        # [B, Hkv, G*W, D] @ [B, Hkv, D, C]: grouped queries share their KV head's keys, no repeat.
        q = inp.queries.reshape(b, hkv, g * w, d)
        logits = torch.matmul(q, inp.keys[:, :, :c].transpose(-1, -2)).float()
        logits.mul_(1.0 / math.sqrt(d))
        logits = logits.view(b, hkv, g, w, c)
        if not bool(inp.slot_valid[..., :c].all()):
            logits.masked_fill_(~inp.slot_valid[:, :, None, None, :c], float("-inf"))
        if self.group_reduce_at == "before_softmax":
            logits = logits.amax(2, keepdim=True) if self.group_reduce == "max" else logits.mean(2, keepdim=True)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row of only padding has no mass
        # Reduce the window as a batched mat-vec that reads the probabilities once; window entries
        # without a real query yet weigh nothing and the mean divides by the real ones.
        weights = inp.query_valid.to(probs.dtype)  # [B, W]
        if self.window_reduce == "mean":
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
        scores = torch.matmul(weights[:, None, None, None, :], probs).squeeze(3)  # [B, Hkv, G', C]
        if self.pooling != "none":
            scores = _pool(scores, self.pooling, self.kernel)
        if self.group_reduce_at == "after_softmax":
            scores = scores.amax(2) if self.group_reduce == "max" else scores.mean(2)
        else:
            scores = scores.squeeze(2)
        out = scores.new_zeros(b, hkv, n)
        out[..., :c] = scores
        return out


def _pool(scores: torch.Tensor, kind: str, kernel: int) -> torch.Tensor:
    """1-D pooling along the last (token) axis, stride 1, zero padding ``kernel // 2``."""
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if kind == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=True)
    else:
        # Scores are non-negative, so zero padding equals max_pool1d's implicit -inf padding.
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    return pooled.reshape(shape)
