"""kvpolicy's merges against kvpress 0.5.5's ``MergingPress`` and ``CAMPress``, on the bundled
model's keys and values (``tests/fixtures/kvpress_parity.pt``) and what kvpress made of them
(``tests/fixtures/kvpress_merge_parity.pt``, from ``benchmarks/parity/capture_kvpress_merge.py``
in kvpress's own venv: ``make parity-fixtures-merge``).

- ``similar`` against ``MergingPress(KnormPress)``: the same kept set (handed over), the merged
  kept values equal to float32 rounding, at thresholds 0 and 0.3 and merge fraction 0.75.
- ``cam`` against ``CAMPress(KnormPress)``, given kvpress's Bernoulli mask (its draws come from
  torch's global generator, kvpolicy's from each row's seeded stream: the one named departure),
  the same cumulative attention and kept set, and every evicted token a candidate: the merge
  probabilities and the merged values equal to float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpolicy.stages import CamMerge, EvictionInput, SimilarMerge

HERE = Path(__file__).parent / "fixtures"
INPUTS, MERGES = HERE / "kvpress_parity.pt", HERE / "kvpress_merge_parity.pt"


@pytest.fixture(scope="module")
def fx():
    if not MERGES.is_file():
        pytest.skip(f"{MERGES.name} is absent: run `make parity-fixtures-merge` (kvpress's venv)")
    data = torch.load(INPUTS, weights_only=True)
    merges = torch.load(MERGES, weights_only=True)
    return data["keys"].float(), data["values"].float(), merges


def _input(keys, values, state=None) -> EvictionInput:
    _, hkv, n, d = keys.shape
    return EvictionInput(
        keys, values, torch.zeros(1, hkv, 1, d), budget=n, num_candidates=n,
        slot_valid=torch.ones(1, hkv, n, dtype=torch.bool), query_valid=torch.ones(1, 1, dtype=torch.bool),
        positions=torch.arange(n).expand(1, hkv, n), state=state,
    )


def test_similar_equals_merging_press(fx):
    keys, values, merges = fx
    assert len(merges["merging"]) == 12
    for (layer, threshold, fraction), case in merges["merging"].items():
        k, v, kept = keys[layer : layer + 1], values[layer : layer + 1], case["kept"]
        keep = torch.zeros(k.shape[:3], dtype=torch.bool).scatter_(-1, kept, True)
        stage = SimilarMerge(similarity_threshold=threshold, merge_fraction=fraction)
        got = stage.merge(_input(k, v), keep).values
        want = case["values"]  # kvpress's result, the kept slots in its topk order
        gathered = got.gather(2, kept[..., None].expand(*kept.shape, v.shape[-1]))
        where = f"layer {layer}, threshold {threshold}, fraction {fraction}"
        torch.testing.assert_close(gathered, want, rtol=1e-5, atol=1e-6, msg=where)
        merged = ~torch.isclose(want, v.gather(2, kept[..., None].expand_as(want))).all(-1)
        assert int(merged.sum()) > 10, f"{where}: the case merges"


def test_cam_equals_cam_press_given_its_mask(fx):
    keys, values, merges = fx
    assert len(merges["cam"]) == 8
    for (layer, budget), case in merges["cam"].items():
        k, v = keys[layer : layer + 1], values[layer : layer + 1]
        hkv, n = k.shape[1], k.shape[2]
        stage = CamMerge(merge_budget=budget, mass="faithful")  # CaM's rule, as CAMPress has it
        inp = _input(k, v, state={stage.attention.state_key: {"attention": case["attention"].float()}})
        keep = torch.zeros(1, hkv, n, dtype=torch.bool)
        keep[..., case["kept"][0]] = True  # kvpress keeps one set for every head
        candidates = case["candidates"][0]
        assert candidates.numel() == n - keep[0, 0].sum(), "every evicted token is a merge candidate"
        draws = torch.zeros(1, hkv, n, dtype=torch.bool)
        draws[..., candidates] = case["mask"].bool()
        p = stage.merge_probability(inp, keep)[..., candidates]
        drew = case["mask"].bool()
        # A token with no kept slot after it has no window: kvpress draws for it (p = x / 0 = 1) and
        # adds nothing; kvpolicy gives it p = 0. Elsewhere kvpress's draws fit kvpolicy's p.
        windowed = (candidates < case["kept"][0].max()).expand_as(drew)
        assert bool((p[drew & windowed] > 0).all()) and bool((p[~drew & windowed] < 1).all()), f"layer {layer}"
        torch.testing.assert_close(p[windowed], case["probability"][windowed], rtol=1e-5, atol=1e-6)
        got = stage.merge_with(inp, keep, draws)
        kept = case["kept"][0]
        want = case["values"]  # [1, Hkv, K, D] in ascending slot order
        torch.testing.assert_close(got[:, :, kept], want, rtol=1e-5, atol=1e-5, msg=f"layer {layer}, budget {budget}")
        assert 0 < int(drew.sum()) < drew.numel(), "the mask merges some candidates and not others"
