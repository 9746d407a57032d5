"""Two stages written to the plugin contract, registered at run time, and one that breaks it.

A stochastic scorer draws only through ``inp.uniform`` (its flag depends on a field, so it is a
property); a reservation declares how many slots it protects with ``reserved_count``. A scorer
that returns ``[B, N]`` instead of ``[B, Hkv, N]`` is refused with a ``SelectionError`` naming it.
"""

from types import SimpleNamespace
from typing import ClassVar

import torch
from pydantic import Field

import kvpolicy
from kvpolicy import EvictionInput, Reservation, Scorer


class NoisyKeyNorm(Scorer):
    """Key norm plus ``noise * U(0, 1)``, drawn afresh at every eviction."""

    type_name: ClassVar[str] = "noisy_key_norm"  # a ClassVar: not a hyperparameter

    noise: float = Field(0.1, ge=0.0, allow_inf_nan=False)

    @property
    def stochastic(self) -> bool:  # depends on a field: a property, not a ClassVar
        return self.noise > 0

    def score(self, inp: EvictionInput) -> torch.Tensor:
        norm = inp.keys.float().norm(dim=-1)  # [B, Hkv, N]; never modify inp.keys in place
        u = inp.uniform(inp.num_kv_heads, inp.num_slots, stream=self.type_name)  # [B, Hkv, N]
        return norm + self.noise * u


class EveryKth(Reservation):
    """Protects the candidates holding every ``k``-th token, at most ``n`` of them per row and head."""

    type_name: ClassVar[str] = "every_kth"

    k: int = Field(16, ge=1)
    n: int = Field(8, ge=0)

    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        # Positions are token indices (they grow past N as tokens are evicted), not slot indices.
        hit = (inp.positions % self.k == 0) & (inp.positions >= 0) & inp.candidate_mask
        return hit & (hit.long().cumsum(-1) <= self.n)  # the first n hits: [B, Hkv, N] bool

    def reserved_count(self, budget: int) -> int:
        return self.n  # load_policy checks recent + reserved <= budget; each eviction checks the bound


class FlatScorer(Scorer):
    """Breaks the contract: one score per row and slot, ``[B, N]``."""

    type_name: ClassVar[str] = "flat_scores"

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return inp.keys.float().norm(dim=-1).mean(1)


plugin = SimpleNamespace(
    kvpolicy_contract=kvpolicy.hookimpl(lambda: 2),  # the plugin contract these stages keep
    kvpolicy_stages=kvpolicy.hookimpl(lambda: [NoisyKeyNorm, EveryKth, FlatScorer]),
)
kvpolicy.get_registry().register_plugin(plugin, name="contract-example")

POLICY = {
    "name": "noisy-every-kth",
    "schedule": {"budget": 64, "recent": 16, "interval": 16, "window": 0},
    "scorer": {"type": "noisy_key_norm", "noise": 0.5},
    "reservations": [{"type": "sinks", "n": 4}, {"type": "every_kth", "k": 16, "n": 8}],
    "selector": {"type": "greedy"},
}
policy = kvpolicy.load_policy(POLICY)
print(policy, "stochastic:", policy.stochastic)

g = torch.Generator().manual_seed(0)
keys, values = torch.randn(2, 2, 200, 16, generator=g), torch.randn(2, 2, 200, 16, generator=g)
queries = torch.zeros(2, 4, 0, 16)  # window 0: an empty window

first = policy.select(keys, values, queries)
assert torch.equal(first, policy.select(keys, values, queries))  # a pure function of its inputs
later = policy.select(keys, values, queries, evictions=1)  # the next eviction draws afresh
print("the next eviction keeps another set:", not torch.equal(first, later))
assert not torch.equal(first, later)
assert set(range(0, 8 * 16, 16)) <= set(first[0, 0].tolist())  # tokens 0, 16, ..., 112 are protected

broken = kvpolicy.load_policy({**POLICY, "name": "broken", "scorer": {"type": "flat_scores"}})
try:
    broken.select(keys, values, queries)
except kvpolicy.SelectionError as err:
    print(err)
else:
    raise AssertionError("a [B, N] score must be refused")
