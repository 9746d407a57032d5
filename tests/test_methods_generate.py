"""Built-in method policies through transformers' ``generate()`` on the tiny test model: a
left-padded batch of two decodes its 30 new tokens, the cache evicts on schedule, and each layer
holds no more than its budget allows (plus what the interval and a padded row's phase add). One
case per policy; what differs between them (the model's depth, the prompt, the policy's
overrides, the bound each layer keeps to, the method's own promise) is the case's data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import kvpolicy

NEW_TOKENS = 30


def _cake_budgets_are_reallocated(cache) -> None:
    """CAKE moves budget between layers: the layers' budgets differ and still sum to 4 x 24."""
    budgets = [s.budget for s in cache.evicting.schedules]
    assert sum(budgets) == 4 * 24 and len(set(budgets)) > 1


def _cake_layer_bounds(cache) -> list[int]:
    """Each layer's own budget (+ the interval, + the padded row's phase)."""
    return [s.budget + 4 + 2 for s in cache.evicting.schedules]


def _lagkv_sinks_stay(cache) -> None:
    """The 4 sinks stay in every layer."""
    for layer in cache.evicting.layers:
        assert bool((layer.positions[..., :4][layer.valid[..., :4]] < 4).all())


@dataclass(frozen=True)
class Case:
    policy: str
    overrides: dict[str, Any]
    layers: int = 2
    length: int = 40
    scorer: dict[str, Any] = field(default_factory=dict)  # set on the named policy's scorer before loading
    min_evictions: int | None = 5  # every layer's stats; None: not checked
    layer_bounds: Callable[[Any], list[int]] | None = None  # most slots per layer; None: not checked
    check: Callable[[Any], None] | None = None  # the method's own promise

    def load(self) -> kvpolicy.Policy:
        if not self.scorer:
            return kvpolicy.load_policy(self.policy, **self.overrides)
        data = kvpolicy.load_policy(self.policy).config.to_dict()
        data["scorer"].update(self.scorer)
        return kvpolicy.load_policy(data, **self.overrides)


def _uniform(bound: int) -> Callable[[Any], list[int]]:
    return lambda cache: [bound] * len(cache.evicting.layers)


SMALL = {"budget": 24, "recent": 4, "window": 4, "interval": 4}
CASES = [
    Case("cake", SMALL, layers=4, length=60, min_evictions=None, layer_bounds=_cake_layer_bounds,
         check=_cake_budgets_are_reallocated),
    Case("chunkkv", SMALL, layer_bounds=_uniform(24 + 4)),
    Case("criticalkv", SMALL),
    Case("expected-attention", SMALL, layer_bounds=_uniform(24 + 4)),
    # partitions that fit the small budget (128 would never be scored)
    Case("lagkv", {"budget": 24, "recent": 4, "interval": 4}, scorer={"lag_size": 4},
         layer_bounds=_uniform(24 + 4), check=_lagkv_sinks_stay),
]


@pytest.mark.parametrize("case", CASES, ids=[c.policy for c in CASES])
def test_generate_on_the_test_model(case: Case):
    pytest.importorskip("transformers")
    from hf_util import generate, left_padded_prompt, tiny_qwen3

    model = tiny_qwen3(layers=case.layers, vocab=256)
    ids, mask = left_padded_prompt(256, batch=2, length=case.length, pads=(0, 6))
    cache = kvpolicy.KVPolicyCache(case.load(), model)
    out = generate(model, cache, ids, mask, NEW_TOKENS)
    assert out.shape == (2, case.length + NEW_TOKENS)
    if case.check is not None:
        case.check(cache)
    if case.min_evictions is not None:
        assert all(s.evictions >= case.min_evictions for s in cache.stats())
    if case.layer_bounds is not None:
        for layer, bound in zip(cache.evicting.layers, case.layer_bounds(cache), strict=True):
            assert max(layer.counts) <= bound
