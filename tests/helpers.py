"""Tensor helpers shared by the stage, selector and policy tests (imported as ``helpers``:
importing from ``conftest`` would find another folder's conftest first), and the base of the
plugins tests register at run time."""

from __future__ import annotations

import importlib.util
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import kvpolicy
from kvpolicy.policy import eviction_input
from kvpolicy.stages.base import EvictionInput


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (the benchmarks are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes of any file fail (``OSError`` EFBIG), as on a full disk: Python
    ignores SIGXFSZ, so the write returns the error instead of the process being killed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


class Contract2Plugin:
    """Base of test plugin objects: declares plugin contract 2, as every plugin must."""

    @kvpolicy.hookimpl
    def kvpolicy_contract(self):
        return 2


def load_fitting(name: str | dict, **overrides: Any) -> kvpolicy.Policy:
    """``load_policy(name, **overrides)``; a two-tier policy whose pages these overrides cannot
    hold (a budget or interval that is not whole pages) with pages small enough to fit (a page
    size dividing the interval and the recall budget), or else without its ``recall`` block: what
    ``Policy.select`` and an eviction keep is the same with or without it."""
    try:
        return kvpolicy.load_policy(name, **overrides)
    except kvpolicy.PolicyError:
        config = kvpolicy.load_policy(name).config
        if config.recall is None:
            raise
        data = config.to_dict()
        recall = data.pop("recall")
        interval = overrides.get("interval", config.schedule.interval)
        budget = overrides.get("budget", config.schedule.budget)
        slots = budget if recall["budget"] == "schedule" else recall["budget"]
        for page in range(min(recall["page_size"], interval), 0, -1):
            if interval % page == 0 and slots % page == 0:
                scorer = {**recall["scorer"], **({"page_size": page} if "page_size" in recall["scorer"] else {})}
                try:
                    return kvpolicy.load_policy({**data, "recall": {**recall, "page_size": page, "scorer": scorer}},
                                                **overrides)
                except kvpolicy.PolicyError:
                    break
        return kvpolicy.load_policy(data, **overrides)


def make_tensors(b=2, hkv=2, hq=4, n=24, d=8, w=4, seed=0, dtype=torch.float32):
    """Random keys, values and queries with the library's shapes."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    values = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    queries = torch.randn(b, hq, w, d, generator=g).to(dtype)
    return keys, values, queries


def make_input(
    keys,
    values,
    queries,
    *,
    recent: int = 4,
    budget: int | None = None,
    slot_valid=None,
    query_valid=None,
    positions=None,
    seed: int = 0,
    layer_idx=0,
    evictions=0,
    streams=0,
) -> EvictionInput:
    """An ``EvictionInput`` as ``Policy.select`` would assemble it (``budget`` None: keep all)."""
    return eviction_input(
        keys, values, queries, budget=keys.shape[2] if budget is None else budget, recent=recent,
        slot_valid=slot_valid, query_valid=query_valid, positions=positions, seed=seed,
        layer_idx=layer_idx, evictions=evictions, streams=streams,
    )


def left_padding(b: int, n: int, pads: list[int]) -> torch.Tensor:
    """``[B, N]`` slot_valid with ``pads[i]`` padding slots at the start of row ``i``."""
    idx = torch.arange(n)
    return torch.stack([idx >= p for p in pads[:b]])


def assert_valid_selection(kept: torch.Tensor, n: int, k: int, protected: torch.Tensor | None = None) -> None:
    """``[B, H, K]`` ascending, unique, in range, and containing every ``protected`` ``[B, H, N]`` slot."""
    assert kept.dtype == torch.long
    assert kept.shape[-1] == k, (kept.shape, k)
    if k > 1:
        assert bool((kept[..., 1:] > kept[..., :-1]).all()), "not strictly ascending"
    assert bool((kept >= 0).all()) and bool((kept < n).all())
    if protected is not None:
        mask = torch.zeros(*kept.shape[:-1], n, dtype=torch.bool).scatter_(-1, kept, True)
        missing = protected & ~mask
        assert not bool(missing.any()), f"protected slots dropped: {missing.nonzero()[:5].tolist()}"


def assert_greedy_matches(kept: torch.Tensor, ref_kept, ref_scores: torch.Tensor, protected_ref, atol=1e-6):
    """The library's kept set equals the reference one, up to swaps between near-tied scores."""
    b_, h_ = kept.shape[:2]
    for b in range(b_):
        for h in range(h_):
            got, want = set(kept[b, h].tolist()), set(ref_kept[b][h])
            if got == want:
                continue
            # Accept only swaps among (near-)ties of the reference score.
            extra, lost = got - want, want - got
            prot = protected_ref[b][h] if protected_ref is not None else set()
            assert not (lost & prot), f"row {b} head {h}: protected {sorted(lost & prot)} dropped"
            worst_kept = min(float(ref_scores[b, h, j]) for j in extra)
            best_lost = max(float(ref_scores[b, h, j]) for j in lost)
            assert best_lost - worst_kept <= atol, (
                f"row {b} head {h}: kept {sorted(extra)} over {sorted(lost)} "
                f"({worst_kept} < {best_lost})"
            )


def model_facts(layers: int = 2, hkv: int = 2, hq: int = 4, d: int = 8, hidden: int = 12, seed: int = 0,
                name: str = "test-model"):
    """``ModelFacts`` of a made-up model of this shape: plain RoPE (base 10000) and a random output
    projection per layer, for policies whose stages read the model (``Policy.needs_model``)."""
    from kvpolicy.stages.model_facts import ModelFacts

    g = torch.Generator().manual_seed(seed)
    projections = torch.randn(layers, hq, d, hidden, generator=g) / d**0.5
    return ModelFacts(
        name=name, num_layers=layers, num_attention_heads=hq, num_kv_heads=hkv, head_dim=d, hidden_size=hidden,
        rope_fn=ModelFacts.standard_rope(d), output_projection_fn=lambda layer: projections[layer],
    )


def facts_for(policy, layers: int = 2, hkv: int = 2, hq: int = 4, d: int = 8):
    """Made-up model facts for ``policy`` if its stages read any, else None; raises
    ``PolicyError`` when the policy cannot serve such a model (a calibration file for another)."""
    if not policy.needs_model:
        return None
    facts = model_facts(layers, hkv, hq, d)
    policy.check_model_facts(facts, num_layers=layers, num_kv_heads=hkv, head_dim=d)
    return facts


def prompt_for(policy):
    """Each row's prompt length for a policy whose stages read it (``needs_prompt``), else None:
    4 tokens, or as many as the budget holds beside the recent buffer and the other reservations."""
    if not policy.needs_prompt:
        return None
    s = policy.schedule
    room = s.budget - s.recent - sum(r.reserved_count(s.budget) for r in policy.config.reservations)
    return max(0, min(4, room))


def random_steps(batch: int, hkv: int, hq: int, d: int, prompt: int, n: int, seed: int, pads=None):
    """A prompt of ``prompt`` tokens, then ``n`` single tokens: ``(k, v, q, valid)`` per step,
    float64, row ``r`` of the prompt left-padded with ``pads[r]`` invalid tokens."""
    g = torch.Generator().manual_seed(seed)
    for i, t in enumerate([prompt] + [1] * n):
        k = torch.randn(batch, hkv, t, d, generator=g, dtype=torch.float64)
        v = torch.randn(batch, hkv, t, d, generator=g, dtype=torch.float64)
        q = torch.randn(batch, hq, t, d, generator=g, dtype=torch.float64) * 2
        valid = torch.ones(batch, t, dtype=torch.bool)
        if i == 0 and pads:
            for r, p in enumerate(pads):
                valid[r, :p] = False
        yield k, v, q, valid


def assert_state_rows_alone(policy, steps, slot_fields, head_fields=()) -> Any:
    """Run ``steps`` (``random_steps``) as one left-padded batch and each row alone, through
    one-layer ``EvictingCache``s: after every step each row holds the positions, and the state
    (``slot_fields`` per slot, ``head_fields`` per head), that it holds alone, bit for bit.
    Returns the batch cache."""
    from kvpolicy import EvictingCache

    batch = EvictingCache(policy, num_layers=1)
    alone = [EvictingCache(policy, num_layers=1) for _ in range(2)]
    for k, v, q, valid in steps:
        batch.attend(0, q, k, v, token_valid=None if bool(valid.all()) else valid)
        for r in range(2):
            keep = valid[r]
            alone[r].attend(0, q[r : r + 1, :, keep], k[r : r + 1, :, keep], v[r : r + 1, :, keep])
        view = batch.layers[0]
        for r in range(2):
            mine = alone[r].layers[0]
            held = view.valid[r]
            heads = held.shape[0]
            assert view.positions[r][held].view(heads, -1).tolist() == mine.positions[0].tolist()
            for name in slot_fields:
                assert torch.equal(view.state[name][r][held].view(heads, -1), mine.state[name][0]), name
            for name in head_fields:
                assert torch.equal(view.state[name][r], mine.state[name][0]), name
    return batch


def assert_padded_row_merges_alone(policy, g: torch.Generator, pad: int, steps: int = 30, *, batch: int = 2,
                                   hkv: int, hq: int, d: int, state_fields=()) -> Any:
    """A 10-token prompt then ``steps`` single tokens (drawn from ``g``) through one-layer
    ``EvictingCache``s, as a batch whose row 1 is left-padded by ``pad`` and as that row alone:
    after every step the row holds the same count, keys, merged values and ``state_fields``, bit
    for bit. Returns the cache of the row alone."""
    from kvpolicy import EvictingCache

    def draw(t: int, b: int = batch) -> tuple[torch.Tensor, ...]:
        return (torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
                torch.randn(b, hq, t, d, generator=g))

    prompt = draw(10)
    token_valid = torch.ones(batch, 10, dtype=torch.bool)
    token_valid[1, :pad] = False
    padded, alone = EvictingCache(policy, num_layers=1), EvictingCache(policy, num_layers=1)
    padded.step(0, *prompt, token_valid)
    alone.step(0, *(t[1:2, :, pad:] for t in prompt))
    for _ in range(steps):
        k, v, q = draw(1)
        padded.step(0, k, v, q)
        alone.step(0, k[1:2], v[1:2], q[1:2])
        row, mine = padded.layers[0], alone.layers[0]
        count = row.counts[1]
        assert count == mine.counts[0]
        assert torch.equal(row.keys[1, :, :count], mine.keys[0])
        assert torch.equal(row.values[1, :, :count], mine.values[0]), "merged values differ"
        for name in state_fields:
            assert torch.equal(row.state[name][1, :, :count], mine.state[name][0]), name
    return alone
