"""The slow tier: pages of evicted tokens, kept apart, with their summaries in the fast tier."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..stages.recall import ROUNDING, SUMMARIES

#: When the slow tier's page slots do not hold an eviction's pages, they grow to this many times
#: the pages needed (amortised copies, as select mode's buffers).
SLOW_GROWTH = 1.5


def similar_key_order(keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[N, E]`` long: an order of each of ``N`` runs of ``E`` keys (``keys [N, E, D]``) whose
    consecutive pages of ``page_size`` hold similar keys, so that a page's summaries (its bounds,
    its mean) describe each of its keys closely.

    Each run is split at the median of its projection onto its keys' principal direction, and the
    halves again, while a half still holds whole pages of an even count (``E = P * 2^k`` splits
    down to single pages); a part that cannot be halved so is ordered along its own principal
    direction. Deterministic: ``eigh`` of each part's covariance, ties by index (a stable sort)."""
    n, e, d = keys.shape
    order = torch.arange(e, device=keys.device).expand(n, e).clone()
    x = keys.float()
    parts = 1
    while True:
        size = e // parts
        halve = size % (2 * page_size) == 0
        if size <= page_size:
            return order
        seg = torch.gather(x, 1, order[..., None].expand(n, e, d)).view(n * parts, size, d)
        centred = seg - seg.mean(1, keepdim=True)
        direction = torch.linalg.eigh(centred.transpose(1, 2) @ centred).eigenvectors[..., -1]  # [n * parts, D]
        projection = (centred @ direction[..., None]).squeeze(-1)  # [n * parts, size]
        within = torch.sort(projection, dim=-1, stable=True).indices
        order = torch.gather(order.view(n * parts, size), 1, within).view(n, e)
        if not halve:
            return order
        parts *= 2


def quantise(summary: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``summary [n, D]`` float32 as int8 values ``[n, D]`` (in a float tensor) and one scale per
    row ``[n]``, rounded as ``ROUNDING[kind]`` says: a lower bound's dequantised value ``q * scale``
    is at most the bound, an upper bound's at least it, exactly as the reader computes it (the
    rounding is corrected by one step where float arithmetic crossed it; the scale leaves one
    step of headroom, so no value is clamped)."""
    scale = summary.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 126
    q = ROUNDING[kind](summary / scale[:, None])
    if kind == "key_max":
        q = q + (q * scale[:, None] < summary).float()
    elif kind == "key_min":
        q = q - (q * scale[:, None] > summary).float()
    return q.clamp(-127, 127), scale


class SlowTier:
    """One layer group's slow tier: per layer, row and KV head, ``Np`` page slots of ``P`` tokens.

    Storage (``keys [Lyr, B, Hkv, Np, P, D]``, ``values``, ``positions [Lyr, B, Hkv, Np, P]``, -1
    for a slot without a token) lives on ``device``: host memory, pinned when the cache is on a
    GPU. What the recall reads lives in the fast tier (``fast``): each page slot's summaries
    (``summaries[kind] [Lyr, B, Hkv, Np, D]``, the keys' dtype, or int8 with ``scales[kind]``), whether it holds a page (``page_valid``),
    when it was written (``page_age``) and its score at the last recall (``page_score``, +inf until
    scored). A page never changes once written; under a ``capacity`` (page slots per head) a full
    tier drops pages for good, the ``drop`` rule deciding which (``oldest`` or ``lowest``).

    Heads of a row hold the same number of pages (every head evicts the same count), though not the
    same tokens; rows hold their own numbers.
    """

    def __init__(
        self, layers: int, batch: int, kv_heads: int, page_size: int, keys: torch.Tensor, values: torch.Tensor,
        summaries: frozenset[str], capacity_pages: int | None = None, drop: str = "oldest",
        device: torch.device | None = None, precision: str = "keys",
    ) -> None:
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.drop = drop
        self.fast = keys.device
        self.device = device if device is not None else (torch.device("cpu") if keys.is_cuda else keys.device)
        self._pin = keys.is_cuda and self.device.type == "cpu"
        self._staging: tuple[torch.Tensor, ...] | None = None  # pinned gather buffers (a GPU cache's)
        self._staging_copied: torch.cuda.Event | None = None  # recorded after copies out of them
        self._shape = (layers, batch, kv_heads)
        self._dims = (keys.shape[-1], values.shape[-1], keys.dtype)
        self.kinds = tuple(sorted(summaries))
        #: int8: each summary stored as int8 with one float32 scale per page (``scales``).
        self.int8 = precision == "int8"
        self.pages_held = torch.zeros(batch, dtype=torch.long)  # host: pages each row holds (per head)
        self.writes = 0  # evictions written (a page's age)
        #: Bytes written to the slow tier, and pages dropped from it for good, since the start.
        self.bytes_written = 0
        self.pages_dropped = 0
        #: Whether every page ever written was whole (``P`` tokens): eviction counts divisible by ``P``.
        self.whole_pages = True
        self._alloc(0)

    def _alloc(self, np_: int) -> None:
        lyr, b, h = self._shape
        d, dv, dtype = self._dims
        p = self.page_size

        def slow(*shape: int, dtype: torch.dtype, fill: float | int = 0) -> torch.Tensor:
            t = torch.full(shape, fill, dtype=dtype, device=self.device)
            return t.pin_memory() if self._pin else t

        self.keys = slow(lyr, b, h, np_, p, d, dtype=dtype)
        self.values = slow(lyr, b, h, np_, p, dv, dtype=dtype)
        self.positions = slow(lyr, b, h, np_, p, dtype=torch.long, fill=-1)
        self.page_valid = torch.zeros(lyr, b, h, np_, dtype=torch.bool, device=self.fast)
        self.page_age = torch.zeros(lyr, b, h, np_, dtype=torch.int32, device=self.fast)
        self.page_score = torch.full((lyr, b, h, np_), float("inf"), device=self.fast)
        if self.int8:
            self.summaries = {k: torch.zeros(lyr, b, h, np_, d, dtype=torch.int8, device=self.fast) for k in self.kinds}
            self.scales = {k: torch.zeros(lyr, b, h, np_, device=self.fast) for k in self.kinds}
            return
        self.scales = {}
        # In the keys' dtype: min and max are keys, exact in it; a mean rounds as a key would.
        self.summaries = {k: torch.zeros(lyr, b, h, np_, d, dtype=dtype, device=self.fast) for k in self.kinds}
        if {"key_min", "key_max"} <= set(self.kinds):  # side by side: Quest reads them in one product
            self._side_by_side(torch.zeros(lyr, b, h, np_, 2, d, dtype=dtype, device=self.fast))

    def _side_by_side(self, bounds: torch.Tensor) -> None:
        self._bounds = bounds
        self.summaries["key_min"], self.summaries["key_max"] = bounds[..., 0, :], bounds[..., 1, :]

    @property
    def page_slots(self) -> int:
        return self.page_valid.shape[3]

    def _grow(self, np_: int) -> None:
        old = (self.keys, self.values, self.positions, self.page_valid, self.page_age, self.page_score)
        summaries, scales = dict(self.summaries), dict(self.scales)
        n = self.page_slots
        self._alloc(np_)
        for new, was in zip((self.keys, self.values, self.positions, self.page_valid, self.page_age, self.page_score),
                            old, strict=True):
            new[:, :, :, :n] = was
        for k, was in summaries.items():
            self.summaries[k][:, :, :, :n] = was
        for k, was in scales.items():
            self.scales[k][:, :, :, :n] = was

    # -- writing --------------------------------------------------------------------------------
    def append(
        self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """Write one eviction's evicted tokens of ``rows`` (host ``[R]``): ``keys [Lyr, R, Hkv, E, D]``,
        ``values``, ``positions [Lyr, R, Hkv, E]`` (ascending per head), as ``ceil(E / P)`` pages per
        head. Returns the page slots dropped for good to make room, ``[Lyr, B, Hkv, Np]`` bool (the
        recall buffer lets go of them), or None when none was."""
        e, p = keys.shape[3], self.page_size
        if e == 0:
            return None
        n_new = -(-e // p)
        pad = n_new * p - e
        if pad:
            self.whole_pages = False
            keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
            values = torch.nn.functional.pad(values, (0, 0, 0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad), value=-1)
        lyr, r, h = keys.shape[:3]
        keys, values = keys.unflatten(3, (n_new, p)), values.unflatten(3, (n_new, p))
        positions = positions.unflatten(3, (n_new, p))
        if self.capacity_pages is not None and n_new > self.capacity_pages:
            # An eviction larger than the whole tier (a long prompt's): its newest pages stay.
            cut = n_new - self.capacity_pages
            # the cut pages count as written and dropped at once: written = (held + dropped) pages
            self.bytes_written += sum(t[:, :, :, :cut].numel() * t.element_size() for t in (keys, values, positions))
            keys, values, positions = keys[:, :, :, cut:], values[:, :, :, cut:], positions[:, :, :, cut:]
            self.pages_dropped += cut * lyr * h * r
            n_new = self.capacity_pages
        dropped = self._make_room(rows, n_new)
        fast_rows = rows.to(self.fast)
        free = ~self.page_valid[:, fast_rows]  # [Lyr, R, Hkv, Np]
        # The first n_new free page slots of each head, ascending (a stable sort puts free ones first).
        target = torch.sort((~free).to(torch.uint8), dim=-1, stable=True).indices[..., :n_new]
        flat = self._flat(fast_rows, target)
        slow_flat = flat.to(self.device)
        self.keys.view(-1, p, keys.shape[-1]).index_copy_(0, slow_flat, keys.flatten(0, 3).to(self.device))
        self.values.view(-1, p, values.shape[-1]).index_copy_(0, slow_flat, values.flatten(0, 3).to(self.device))
        self.positions.view(-1, p).index_copy_(0, slow_flat, positions.flatten(0, 3).to(self.device))
        valid = positions >= 0  # [Lyr, R, Hkv, n_new, P]
        for kind in self.kinds:
            summary = SUMMARIES[kind](keys, valid).flatten(0, 3)  # [Lyr * R * Hkv * n_new, D]
            into = self.summaries[kind]
            if self.int8:
                summary, scale = quantise(summary, kind)
                self.scales[kind].view(-1).index_copy_(0, flat, scale)
            into.view(-1, summary.shape[-1]).index_copy_(0, flat, summary.to(into.dtype))
        self.page_valid.view(-1)[flat] = True
        self.page_age.view(-1)[flat] = self.writes
        self.page_score.view(-1)[flat] = float("inf")
        self.writes += 1
        self.pages_held[rows] += n_new
        self.bytes_written += sum(t.numel() * t.element_size() for t in (keys, values, positions))
        return dropped

    def _flat(self, fast_rows: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
        """Flat indices into ``[Lyr * B * Hkv * Np]`` of ``page [Lyr, R, Hkv, n]`` of ``fast_rows``."""
        lyr, b, h = self._shape
        np_ = self.page_slots
        layer = torch.arange(lyr, device=self.fast)[:, None, None, None]
        head = torch.arange(h, device=self.fast)[None, None, :, None]
        return (((layer * b + fast_rows[None, :, None, None]) * h + head) * np_ + page).flatten()

    def _make_room(self, rows: torch.Tensor, n_new: int) -> torch.Tensor | None:
        """Grow (unbounded, or up to the capacity) or drop pages until each head of ``rows`` has
        ``n_new`` free page slots; the dropped page slots, or None."""
        held = int(self.pages_held[rows].max())
        needed = held + n_new
        if needed > self.page_slots:
            grown = max(needed, int(self.page_slots * SLOW_GROWTH))
            if self.capacity_pages is not None:
                grown = min(grown, self.capacity_pages)
            if grown > self.page_slots:
                self._grow(grown)
        over = (self.pages_held[rows] + n_new - self.page_slots).clamp(min=0)  # [R] pages to drop per head
        if not bool((over > 0).any()):
            return None
        fast_rows = rows.to(self.fast)
        valid = self.page_valid[:, fast_rows]
        # Lowest priority goes first: the oldest written, or the lowest scored at the last recall.
        priority = (self.page_age.float() if self.drop == "oldest" else self.page_score)[:, fast_rows]
        priority = priority.masked_fill(~valid, float("inf"))
        order = priority.argsort(dim=-1, stable=True)  # [Lyr, R, Hkv, Np], lowest first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=self.fast).expand_as(order))
        gone_rows = valid & (rank < over.to(self.fast)[None, :, None, None])
        dropped = torch.zeros_like(self.page_valid)
        dropped[:, fast_rows] = gone_rows
        self.page_valid &= ~dropped
        self.pages_held[rows] -= over
        self.pages_dropped += int(gone_rows.sum())
        return dropped

    # -- reading --------------------------------------------------------------------------------
    def read_summaries(self, layer: int, rows: slice | torch.Tensor, kinds: frozenset[str]) -> Mapping[str, torch.Tensor]:
        if self.int8:
            # int8 times the float32 scale: one product, promoted to float32 (exact as .float() first).
            return {k: self.summaries[k][layer, rows] * self.scales[k][layer, rows][..., None] for k in kinds}
        return {k: self.summaries[k][layer, rows].float() for k in kinds}

    def gather(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pages at flat page-slot indices ``flat [n]`` (``_flat``'s), on the slow device:
        ``keys [n, P, D]``, ``values [n, P, Dv]``, ``positions [n, P]``."""
        p = self.page_size
        where = flat.to(self.device)
        sources = (self.keys.view(-1, p, self.keys.shape[-1]), self.values.view(-1, p, self.values.shape[-1]),
                   self.positions.view(-1, p))
        if not self._pin:
            return tuple(t.index_select(0, where) for t in sources)  # type: ignore[return-value]
        # Gathered into pinned staging buffers, so the copy to the GPU can be asynchronous.
        n = where.numel()
        if self._staging_copied is not None:  # the last copies out of the staging buffers are done
            self._staging_copied.synchronize()
            self._staging_copied = None
        if self._staging is None or self._staging[0].shape[0] < n:
            self._staging = tuple(torch.empty((max(n, 64), *t.shape[1:]), dtype=t.dtype).pin_memory() for t in sources)
        out = tuple(buf[:n] for buf in self._staging)
        for t, buf in zip(sources, out, strict=True):
            torch.index_select(t, 0, where, out=buf)
        return out  # type: ignore[return-value]

    def copied_out(self) -> None:
        """The pages ``gather`` gave were copied out on the current stream (asynchronously, from
        pinned staging buffers): the next ``gather`` waits for those copies before reusing them."""
        if self._pin:
            self._staging_copied = torch.cuda.Event()
            self._staging_copied.record()

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        slow = host.to(self.device)
        self.keys, self.values, self.positions = (t.index_select(1, slow) for t in (self.keys, self.values, self.positions))
        if self._pin:
            self.keys, self.values, self.positions = (t.pin_memory() for t in (self.keys, self.values, self.positions))
        self.page_valid, self.page_age, self.page_score = (
            t.index_select(1, dev) for t in (self.page_valid, self.page_age, self.page_score))
        self.summaries = {k: t.index_select(1, dev) for k, t in self.summaries.items()}
        self.scales = {k: t.index_select(1, dev) for k, t in self.scales.items()}
        if not self.int8 and {"key_min", "key_max"} <= set(self.kinds):
            self._side_by_side(self._bounds.index_select(1, dev))
        self.pages_held = self.pages_held[host]
        self._shape = (self._shape[0], host.numel(), self._shape[2])

    # -- bytes ----------------------------------------------------------------------------------
    def slow_bytes(self) -> int:
        """Bytes the slow tier's storage takes (its whole room)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))

    def summary_bytes(self) -> int:
        """Bytes of what the slow tier keeps in the fast tier, its whole room: summaries and page
        bookkeeping of every page slot."""
        return self.page_slots * self._page_fast_bytes() * self._shape[0] * self._shape[1] * self._shape[2]

    def held_summary_bytes(self) -> int:
        """``summary_bytes`` of the pages held only (each row's, on every layer and head)."""
        return int(self.pages_held.sum()) * self._page_fast_bytes() * self._shape[0] * self._shape[2]

    def _page_fast_bytes(self) -> int:
        """Fast-tier bytes of one page slot of one layer and head: its summaries and bookkeeping."""
        fast = [*self.summaries.values(), *self.scales.values(), self.page_valid, self.page_age, self.page_score]
        return sum(t.element_size() * (t.shape[-1] if t.dim() == 5 else 1) for t in fast)
