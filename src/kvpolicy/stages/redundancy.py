"""Key redundancy (R-KV): how much a slot's key repeats other keys."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer


class RedundancyScorer(Scorer):
    """Softmax over slots of the mean cosine similarity of each key to the others.

    ``Kn = K / (||K|| + 1e-8)``, ``C = Kn Kn^T`` with a zero diagonal. With ``threshold`` set
    (official R-KV: 0.5), each row ``i`` zeroes its most recent column ``j`` with ``C[i, j] >
    threshold`` (column 0 when there is none), so the latest duplicate is not counted as
    redundant. ``red_j = softmax_j(mean_i C[i, j])``.

    ``over="all"`` (official R-KV) uses every cached slot as rows and columns, takes the softmax
    over all of them and then drops the recent columns; ``over="candidates"`` (VaSE's
    re-implementation) uses the candidates only. The ``N x N`` matrix is never materialised
    whole: rows are processed in chunks of at most ``chunk_elements`` similarity entries.

    Higher means *more* redundant: combine it with a negative weight.
    """

    type_name: ClassVar[str] = "redundancy"

    threshold: float | None = Field(0.5, ge=-1.0, le=1.0)
    over: Literal["all", "candidates"] = "all"
    chunk_elements: int = Field(1 << 25, ge=1 << 10, description="Similarity entries per row chunk.")

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, h, n, _ = inp.keys.shape
        m = n if self.over == "all" else inp.num_candidates
        k = inp.keys[:, :, :m].float()
        kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        valid = inp.slot_valid[..., :m]  # [B, Hkv, M]
        kn = kn * valid[..., None]  # padding rows and columns contribute zero similarity
        col_sum = kn.new_zeros(b, h, m)
        cols = torch.arange(m, device=k.device)
        rows_per_chunk = max(1, self.chunk_elements // max(1, b * h * m))
        for start in range(0, m, rows_per_chunk):
            stop = min(m, start + rows_per_chunk)
            sim = torch.matmul(kn[:, :, start:stop], kn.transpose(-1, -2))  # [B, H, r, M]
            rows = torch.arange(start, stop, device=k.device)
            sim[:, :, rows - start, rows] = 0.0
            if self.threshold is not None:
                # Most recent column above the threshold per row (argmax of index-weighted mask;
                # 0 when none, as in the official code).
                last = ((sim > self.threshold) * cols).argmax(-1, keepdim=True)
                sim.scatter_(-1, last, 0.0)
            col_sum += sim.sum(2)
        n_rows = valid.sum(-1, keepdim=True).clamp_min(1).to(col_sum.dtype)
        mean_sim = (col_sum / n_rows).masked_fill(~valid, float("-inf"))
        red = torch.softmax(mean_sim, dim=-1).nan_to_num_(0.0)
        out = red.new_zeros(b, h, n)
        c = inp.num_candidates
        out[..., :c] = red[..., :c]
        return out
