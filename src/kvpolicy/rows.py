"""Per-row counters of a layer group: slots held, real tokens seen, whether an eviction is due.

They live on the host as ``[B]`` long tensors: the schedule is host control flow, so decoding
needs no device-to-host sync. While every row holds the same slots after the same tokens (no
padding: the decoding hot path) they are held as four plain ints instead, and the tensors are
filled in only when read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Alike(NamedTuple):
    """What every row shares while the rows are alike (the decoding hot path)."""

    held: int  # slots held, after the current step
    before: int  # ... before it
    tokens: int  # real tokens seen
    due: bool  # an eviction is due


class RowCounters:
    """Slots held (after and before the current step), tokens seen and due flags of ``B`` rows,
    plus each row's eviction count and random stream (what keys its draws)."""

    def __init__(self, batch: int) -> None:
        zeros = torch.zeros(batch, dtype=torch.long)
        self._counts = zeros.clone()  # slots held per row, after the current step
        self._counts_before = zeros.clone()  # ... before it (what layers that did not write it yet hold)
        self._tokens = zeros.clone()  # real tokens seen per row
        self._due = torch.zeros(batch, dtype=torch.bool)  # evict before the next step
        self._alike: Alike | None = Alike(0, 0, 0, False)
        self.stored = zeros.clone()  # slots [0, stored) have their positions written out
        self.evictions = zeros.clone()  # evictions each row has had (keys its random draws)
        self.observed = zeros.clone()  # real tokens whose queries the policy's state has seen
        self._observed_alike: int | None = 0  # ... as one int while every row has the same
        self.streams = zeros.clone()  # each row's random stream (see kvpolicy.seeds)
        self.prompt = zeros.clone()  # real tokens of each row's prompt (its steps before the first decode step)

    # -- reading ------------------------------------------------------------------------------
    def _rows(self) -> None:
        """Fill the per-row tensors from the ints of the alike fast path, and leave it."""
        if self._alike is not None:
            count, before, tokens, due = self._alike
            # A cache built under torch.inference_mode holds inference tensors, which may be
            # written only in that mode; a reader (stats, held counts) may come after it.
            with torch.inference_mode(torch.is_inference(self._counts)):
                self._counts.fill_(count)
                self._counts_before.fill_(before)
                self._tokens.fill_(tokens)
                self._due.fill_(due)
            self._alike = None

    def _check_alike(self) -> None:
        """Back to the fast path when every row holds the same slots after the same tokens."""
        c, t, b, d = self._counts, self._tokens, self._counts_before, self._due
        if bool((c == c[0]).all() and (t == t[0]).all() and (b == b[0]).all() and (d == d[0]).all()):
            self._alike = Alike(int(c[0]), int(b[0]), int(t[0]), bool(d[0]))

    @property
    def alike(self) -> Alike | None:
        """What every row shares, or None (rows differ)."""
        return self._alike

    @property
    def counts(self) -> torch.Tensor:
        """``[B]`` slots held per row (after the current step)."""
        self._rows()
        return self._counts

    @property
    def counts_before(self) -> torch.Tensor:
        self._rows()
        return self._counts_before

    @property
    def tokens(self) -> torch.Tensor:
        """``[B]`` real tokens seen per row."""
        self._rows()
        return self._tokens

    def held(self) -> torch.Tensor:
        """``[B]`` slots held per row (after the current step), read without leaving the fast path."""
        alike = self._alike
        return self._counts if alike is None else torch.full_like(self.observed, alike.held)

    def seen(self) -> torch.Tensor:
        """``[B]`` real tokens seen per row, read without leaving the fast path."""
        alike = self._alike
        return self._tokens if alike is None else torch.full_like(self.observed, alike.tokens)

    def unobserved(self) -> torch.Tensor:
        """``[B]`` real queries each row has seen that the policy's state has not."""
        return self.seen() - self.observed

    def most_unobserved(self) -> int | None:
        """The unseen queries of every row as one int while the rows are alike and their state
        saw the same (the decoding hot path: no tensor touched), else None."""
        alike = self._alike
        if alike is None or self._observed_alike is None:
            return None
        return alike.tokens - self._observed_alike

    def mark_observed(self, rows: torch.Tensor | slice) -> None:
        """The state has seen every query of ``rows`` (host ``[R]``, or a slice)."""
        self.observed[rows] = self.seen()[rows]
        first = self.observed[:1]
        self._observed_alike = int(first) if bool((self.observed == first).all()) else None

    @property
    def due(self) -> torch.Tensor:
        """``[B]`` bool: rows the schedule says must be evicted before the next step."""
        self._rows()
        return self._due

    @property
    def any_due(self) -> bool:
        return self._alike.due if self._alike is not None else bool(self._due.any())

    def resume_alike(self) -> None:
        """Back to the int fast path after a read left it, if the rows are still alike."""
        if self._alike is None:
            self._check_alike()

    # -- writing ------------------------------------------------------------------------------
    def advance_alike(self, t: int, due: bool) -> None:
        """Every row appended ``t`` real tokens (the fast path stays)."""
        alike = self._alike
        assert alike is not None
        self._alike = Alike(alike.held + t, alike.held, alike.tokens + t, due)

    def advance(self, after: torch.Tensor, added: torch.Tensor, due: torch.Tensor) -> None:
        """Rows now hold ``after [B]`` slots after ``added [B]`` more real tokens."""
        self._rows()
        self._counts_before, self._counts = self._counts, after
        self._tokens = self._tokens + added
        self._due = due
        self._check_alike()

    def evicted(self, rows: torch.Tensor, kept: int) -> int:
        """``rows`` (host ``[R]``) now hold ``kept`` slots; returns the slots dropped."""
        self._rows()
        dropped = int((self._counts[rows] - kept).sum())
        for t in (self._counts, self._counts_before, self.stored):
            t[rows] = kept
        self.evictions[rows] += 1
        self._due[rows] = False
        self._check_alike()
        return dropped

    def select_rows(self, host: torch.Tensor) -> None:
        self._rows()
        for name in ("_counts", "_counts_before", "_tokens", "stored", "evictions", "streams", "observed", "prompt", "_due"):
            setattr(self, name, getattr(self, name)[host])
        if self._observed_alike is None and host.numel() and bool((self.observed == self.observed[0]).all()):
            self._observed_alike = int(self.observed[0])
        if host.numel():
            self._check_alike()
