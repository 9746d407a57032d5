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
    reads_values: ClassVar[bool] = False

    threshold: float | None = Field(
        0.5, ge=-1.0, le=1.0, allow_inf_nan=False, description="A cosine similarity in [-1, 1], or null."
    )
    over: Literal["all", "candidates"] = "all"
    chunk_elements: int = Field(
        1 << 21,
        ge=1 << 10,
        le=1 << 28,
        description="Similarity entries per tile (performance only; results do not depend on it); at "
        "most 2**28 (1 GiB of float32), far above where larger tiles stop paying.",
    )

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, h, n, _ = inp.keys.shape
        m = n if self.over == "all" else inp.num_candidates
        k = inp.keys[:, :, :m].float()
        valid = inp.slot_valid[..., :m]  # [B, Hkv, M]
        norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True)
        # One scale per key: unit length, and zero for empty slots (no similarity to anything).
        scale = valid[..., None] / (norm + 1e-8)
        kn = k * scale
        # Column sums of C = Kn Kn^T without the matrix: sum_i C[i, j] = (sum_i Kn_i) . Kn_j, minus
        # the zeroed diagonal Kn_j . Kn_j = (||K_j|| * scale_j)^2. O(M D) instead of O(M^2 D).
        col_sum = torch.matmul(kn, kn.sum(2, keepdim=True).transpose(-1, -2)).squeeze(-1)
        col_sum -= (norm * scale).squeeze(-1).square()
        if self.threshold is not None:
            col_sum -= self._threshold_correction(kn, valid, self.threshold)
        n_rows = valid.sum(-1, keepdim=True).clamp_min(1).to(col_sum.dtype)
        mean_sim = (col_sum / n_rows).masked_fill(~valid, float("-inf"))
        red = torch.softmax(mean_sim, dim=-1).nan_to_num_(0.0)
        c = inp.num_candidates
        if c == m:
            return red if m == n else torch.nn.functional.pad(red, (0, n - m))
        out = red.new_zeros(b, h, n)
        out[..., :c] = red[..., :c]
        return out

    def _threshold_correction(self, kn: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
        """``[B, H, M]``: per column, the sum of the entries the threshold step zeroes.

        Row ``i`` zeroes its most recent column ``j`` with ``C[i, j] > threshold`` (column 0 when
        there is none: the row's first cached token, its first valid slot ``valid [B, H, M]``, so
        a left-padded row scores as it does alone). The similarity rows are computed in chunks against the keys in *reversed*
        order, so that the most recent match is the first one: a bool mask and an ``argmax`` over
        it, without index-weighted temporaries.
        """
        b, h, m, d = kn.shape
        kn = kn.flatten(0, 1)  # [BH, M, D]
        kn_rev_t = kn.flip(1).transpose(1, 2)  # [BH, D, M], column m-1-j holds slot j
        oldest = valid.flatten(0, 1).to(torch.uint8).argmax(-1)  # [BH]: first valid slot (0 when none)
        correction = kn.new_zeros(b * h, m)
        # Tiles of (rows of the flattened batch*head axis) x (similarity rows), sized so that a
        # tile's similarities stay in cache across the matmul, the threshold and the argmax.
        rows_per_tile = max(1, min(m, self.chunk_elements // m))
        bh_per_tile = max(1, self.chunk_elements // (rows_per_tile * m))
        buf = mask = None  # reused across tiles: fresh large tensors cost page faults every time
        for b0 in range(0, b * h, bh_per_tile):
            b1 = min(b * h, b0 + bh_per_tile)
            for start in range(0, m, rows_per_tile):
                stop = min(m, start + rows_per_tile)
                shape = (b1 - b0, stop - start, m)
                if buf is None or mask is None or buf.shape != shape:
                    buf = kn.new_empty(shape)
                    mask = torch.empty(shape, dtype=torch.bool, device=kn.device)
                sim = torch.bmm(kn[b0:b1, start:stop], kn_rev_t[b0:b1], out=buf)  # reversed columns
                rows = torch.arange(start, stop, device=kn.device)
                sim[:, rows - start, m - 1 - rows] = 0.0  # zero diagonal
                torch.gt(sim, threshold, out=mask)
                first = mask.view(torch.uint8).argmax(-1, keepdim=True)  # [T, r, 1]
                hit = sim.gather(-1, first)
                found = hit > threshold
                fallback = oldest[b0:b1, None, None].expand(-1, stop - start, 1)  # [T, r, 1]
                col = torch.where(found, m - 1 - first, fallback)
                # no match: the row's first cached token (column 0 unless the row is left-padded)
                val = torch.where(found, hit, sim.gather(-1, m - 1 - fallback))
                correction[b0:b1].scatter_add_(-1, col.squeeze(-1), val.squeeze(-1))
        return correction.view(b, h, m)
