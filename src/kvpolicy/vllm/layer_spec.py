"""A KV-cache spec per attention layer: how a server under per-layer budgets gets one KV-cache
group, so one block table, per layer (imported only in vLLM processes: it subclasses vLLM's spec).

vLLM groups layers by their KV-cache spec (``vllm.v1.core.kv_cache_utils.get_kv_cache_groups``):
layers whose specs merge share one group and one block table. ``LayerKVCacheSpec`` is vLLM's
``FullAttentionSpec`` carrying the layer's index; two layers' specs never merge
(``merge`` raises, ``is_uniform_with_collection`` is False across layers), so vLLM builds one
group per layer. Every group's block has the same page size (one layer's keys and values of
``block_size`` tokens), so all groups draw from the one shared block pool, and vLLM's
``FullAttentionManager`` (found through the spec's base class) manages each group's blocks.
A block of such a group holds one layer: memory follows each layer's own slot count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec


@dataclass(frozen=True, kw_only=True)
class LayerKVCacheSpec(FullAttentionSpec):
    """``FullAttentionSpec`` of one attention layer (``kvpolicy_layer``: the model's layer index)."""

    kvpolicy_layer: int = -1

    @classmethod
    def merge(cls, specs: list) -> LayerKVCacheSpec:
        layers = {getattr(s, "kvpolicy_layer", None) for s in specs}
        # vLLM catches AssertionError (and ValueError) as "these specs do not share a group".
        if len(layers) != 1:
            raise AssertionError("kvpolicy: under per-layer budgets every attention layer has a KV cache group of its own")
        merged = super().merge(specs)
        return dataclasses.replace(merged, kvpolicy_layer=layers.pop())

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(isinstance(s, LayerKVCacheSpec) and s.kvpolicy_layer == self.kvpolicy_layer
                   for s in kv_cache_specs.values())


def layer_spec(spec: FullAttentionSpec, layer: int) -> LayerKVCacheSpec:
    """``spec`` (a plain full-attention spec) as the spec of layer ``layer``'s own group."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return LayerKVCacheSpec(**fields, kvpolicy_layer=layer)
