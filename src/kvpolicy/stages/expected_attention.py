"""Expected Attention: the attention future queries are expected to pay each key (arXiv 2510.00636)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .model_facts import Fact, rotate_half, unrotate


class ExpectedAttentionScorer(Scorer):
    """Expected attention of future queries, from the statistics of the window's, times ``||v||``.

    1. The window's valid queries at token positions ``>= n_sink`` are taken back to before RoPE
       (each by its own position, ``inp.query_positions``); per query head, their mean ``mu`` and
       biased covariance ``Sigma``.
    2. The future queries' rotation is the mean RoPE matrix ``R`` over the next
       ``n_future_positions`` positions (after the newest query): ``mu' = R mu``,
       ``Sigma' = R Sigma R^T``.
    3. Per query head and key (post-RoPE, as cached): ``z = mu' . k / sqrt(D) + k^T Sigma' k / (2D)``,
       the log of the expected ``exp(q . k / sqrt(D))`` of a Gaussian query; a softmax over the
       slots (``softmax_over``; keys at positions ``< n_sink`` left out, as the sinks they are);
       the mean over the ``G`` query heads of the KV head; then ``(a + epsilon) * ||v||_2``.

    Slots outside the softmax score 0: pair it with a ``sinks`` reservation of ``n_sink``.
    """

    type_name: ClassVar[str] = "expected_attention"
    reads_queries: ClassVar[bool] = True
    needs_model: ClassVar[frozenset[Fact]] = frozenset({"rope"})

    n_future_positions: int = Field(512, ge=1, le=1 << 16, description="Future positions the RoPE rotation is averaged over.")
    n_sink: int = Field(4, ge=0, le=1 << 24, description="Tokens at positions below it are left out of the statistics and the softmax.")
    use_covariance: bool = Field(True, description="Add the quadratic (covariance) term to the expected logit.")
    use_vnorm: bool = Field(True, description="Multiply by each value's L2 norm.")
    epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Added to the attention before the value norm.")
    tile_elements: int = Field(
        1 << 24, ge=1, le=1 << 28,
        description="Entries of the quadratic form computed per tile (performance only; results do not depend on it).",
    )
    softmax_over: Literal["all", "candidates"] = Field(
        "all",
        description="The slots each head's softmax runs over (sinks excluded): every valid slot, as future "
        "queries see them all (kvpress), or the candidates only.",
    )

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, d = inp.keys.shape
        g = inp.group_size
        mu, cov = self.future_statistics(inp)  # [B, Hq, D], [B, Hq, D, D]
        keys = inp.keys.float()
        logits = torch.einsum("bhgd,bhnd->bhgn", mu.view(b, hkv, g, d), keys) / math.sqrt(d)
        if self.use_covariance:  # k^T Sigma' k in tiles of slots: [B, Hkv, n, G, D] at a time
            # The G heads' Sigma' side by side, [B * Hkv, D, G * D], laid out once for every tile.
            cov = cov.view(b, hkv, g, d, d).permute(0, 1, 3, 2, 4).reshape(b * hkv, d, g * d)
            chunk = max(1, self.tile_elements // max(1, b * hkv * g * d))
            for s0 in range(0, n, chunk):
                k = keys[:, :, s0 : s0 + chunk]
                m = k.shape[2]
                spread = torch.bmm(k.reshape(b * hkv, m, d), cov).view(b, hkv, m, g, d)
                logits[..., s0 : s0 + chunk] += (spread * k[:, :, :, None]).sum(-1).transpose(2, 3) / (2 * d)
        inside = inp.slot_valid & (inp.positions >= self.n_sink)
        if self.softmax_over == "candidates":
            inside = inside & inp.candidate_mask
        logits = logits.masked_fill(~inside[:, :, None], float("-inf"))
        attention = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(2)  # a head with no slot: 0
        if self.use_vnorm:
            attention = (attention + self.epsilon) * inp.values.float().norm(dim=-1)
        return attention.masked_fill(~inside, 0.0)

    def future_statistics(self, inp: EvictionInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu', Sigma')``: the mean ``[B, Hq, D]`` and covariance ``[B, Hq, D, D]`` of the future
        queries (steps 1 and 2 of the class docstring), float32. A row without a valid query
        has both 0."""
        facts = inp.facts(self)
        qpos = inp.query_positions
        queries = inp.queries.float()
        cos, sin = facts.rope(qpos.clamp_min(0))  # [B, W, D]
        pre = unrotate(queries, cos[:, None], sin[:, None])  # [B, Hq, W, D]
        used = (inp.query_valid & (qpos >= self.n_sink)).to(pre.device)
        weight = used.float()[:, None, :, None]
        count = used.sum(-1).clamp_min(1).float()[:, None, None]  # [B, 1, 1]
        every = bool(used.all())  # weights all 1 (x * 1.0 is x): the two products skipped
        mu = (pre if every else pre * weight).sum(2) / count
        centred = pre - mu[:, :, None] if every else (pre - mu[:, :, None]) * weight
        cov = centred.transpose(-1, -2) @ centred / count[..., None]
        # The mean rotation over the future positions: R = diag(c) + diag(s) P, P x = rotate_half(x).
        newest = qpos.amax(-1).clamp_min(0)  # [B]
        # Once per distinct newest position: rows of one request share it in every layer (vLLM
        # stacks a request's layers as rows), and each row's mean depends on it alone.
        distinct, row_of = newest.unique(return_inverse=True)
        future = distinct[:, None] + 1 + torch.arange(self.n_future_positions, device=newest.device)
        fcos, fsin = facts.rope(future)  # [U, F, D]
        c, s = fcos.mean(1)[row_of], fsin.mean(1)[row_of]  # [B, D]
        mu_future = c[:, None] * mu + s[:, None] * rotate_half(mu)
        if not self.use_covariance:
            return mu_future, torch.zeros_like(cov)
        rotation = torch.diag_embed(c) + s[:, :, None] * rotate_half_matrix(inp.head_dim, c.device)  # [B, D, D]
        cov_future = rotation[:, None] @ cov @ rotation[:, None].transpose(-1, -2)
        return mu_future, cov_future


def rotate_half_matrix(d: int, device: torch.device) -> torch.Tensor:
    """``P`` ``[D, D]`` float32 with ``P x = rotate_half(x)``."""
    return rotate_half(torch.eye(d, device=device)).T.contiguous()
