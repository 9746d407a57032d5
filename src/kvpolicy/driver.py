"""The step driver: how every engine runs a due eviction or a state update, over any slot store.

*What* is kept is decided by ``kvpolicy.eviction``; *when*, by ``Schedule.step_due`` and
``eviction.must_observe``. This module is the *how*, written once: for each class of rows that
evict together (rows of one policy holding one count, each seeing its slots as it would alone),
gather what the policy sees, let the core decide, write back what it keeps (or, for an update,
the new state), and count that the state has now seen every query of those rows.

An engine's storage of slots implements ``SlotStore``: the transformers caches through
``kvpolicy.executor.GroupStore`` (a ``LayerGroup`` and its layout), vLLM's paged cache as
``kvpolicy.vllm.paged_cache.PagedCache`` itself (a step's requests in their KV blocks, a class of
them being a ``kvpolicy.vllm.requests.RequestClass``). Neither writes the loop, so both keep the
same order: a row's state is recorded as up to date exactly when its eviction or update has been
written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

import torch

from . import eviction
from .policy import Policy
from .stages.base import EvictionInput

__all__ = ["Gathered", "SlotStore", "evict", "observe"]

Rows = TypeVar("Rows", contravariant=True)
G = TypeVar("G", bound="Gathered")
Out = TypeVar("Out", covariant=True)


class Gathered(Protocol):
    """What a store gathered for one class of rows: at least the policy's input."""

    @property
    def inp(self) -> EvictionInput: ...


class SlotStore(Protocol[Rows, G, Out]):
    """What the driver asks of an engine's slots. ``Rows`` is the store's own name for a class of
    rows evicted together; the driver only hands it back.

    - ``gather(rows)``: what the policy sees of them (``Gathered.inp``, every layer stacked on the
      batch axis), and whatever the store needs to write back (the addresses it read).
    - ``compact(rows, gathered, kept)``: move what the eviction kept (``kept``: slots, or a mask
      with counts per head, merged values, new state) into place, free the rest; its return value
      is the store's own record of it, collected by ``evict``.
    - ``write_state(rows, gathered, state)``: store an updated state (``Policy.state_fields`` by
      name, arranged as gathered) in the slots it was read from, moving none.
    - ``observed(rows)``: count that their state has seen every query so far.
    """

    def gather(self, rows: Rows) -> G: ...

    def compact(self, rows: Rows, gathered: G, kept: eviction.Kept) -> Out: ...

    def write_state(self, rows: Rows, gathered: G, state: Mapping[str, torch.Tensor]) -> None: ...

    def observed(self, rows: Rows) -> None: ...


def evict(store: SlotStore[Rows, G, Out], policy: Policy, classes: Iterable[Rows]) -> list[Out]:
    """Evict each class of rows (``eviction.evict``); returns what ``store.compact`` gave for each.
    An eviction brings the rows' state up to date with every query, so they are counted observed."""
    out = []
    for rows in classes:
        gathered = store.gather(rows)
        out.append(store.compact(rows, gathered, eviction.evict(policy, gathered.inp)))
        store.observed(rows)
    return out


def observe(store: SlotStore[Rows, G, Out], policy: Policy, classes: Iterable[Rows]) -> None:
    """Bring each class of rows' state up to date with its window's unseen queries
    (``eviction.observe``), evicting nothing: before a step's queries push unseen ones out."""
    for rows in classes:
        gathered = store.gather(rows)
        store.write_state(rows, gathered, eviction.observe(policy, gathered.inp))
        store.observed(rows)
