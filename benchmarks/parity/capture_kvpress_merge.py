"""Capture kvpress's merges (``MergingPress``, ``CAMPress``) for tests/test_kvpress_merge_parity.py.

Runs in kvpress's virtual env (``.venv-kvpress``, ``make parity-fixtures-merge``) and never
imports kvpolicy. Its inputs are the keys and values the main parity fixture captured from the
bundled model (``tests/fixtures/kvpress_parity.pt``: four layers, 1,024 tokens, float16, upcast to
float32 as every press there reads them), so no model is loaded.

What it stores in ``--out`` (a ``torch.save`` dict, read with ``weights_only=True``), per layer:

- ``merging``: ``MergingPress`` over ``KnormPress`` (compression ratio 0.75: 256 of 1,024 kept),
  at each of ``MERGING_SETTINGS`` (similarity threshold, merge fraction): the kept slots
  (``topk`` of the scorer, as the press computes them) and the values ``compress`` returns
  (float32, in the order of the kept slots);
- ``cam``: ``CAMPress`` over ``KnormPress`` (target size 256), called at a compression with every
  one of the 768 evicted tokens a merge candidate (its step count set to 768), for each
  ``merge_budget`` of ``CAM_BUDGETS``, on a cumulative attention computed here from the
  fixture's window queries (each query's softmax over every key, averaged over the query heads
  of a KV head, summed over the window): the attention handed to it, the kept slots, the merge
  candidates, the merge probabilities and the Bernoulli mask it drew from them (recorded by
  wrapping ``torch.bernoulli``; torch's global generator seeded with 0) and the values it returns.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import math
from pathlib import Path
from types import SimpleNamespace

import torch

MERGING_SETTINGS = ((0.0, 1.0), (0.3, 1.0), (0.0, 0.75))
CAM_BUDGETS = (32, 4)
KEPT = 256


def cumulative_attention(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``[1, Hkv, N]``: every window query's softmax over all ``N`` keys, averaged over the query
    heads of each KV head, summed over the window (a decode-time running sum's shape)."""
    hkv, n, d = keys.shape
    hq, w, _ = queries.shape
    k = keys.repeat_interleave(hq // hkv, dim=0)  # [Hq, N, D]
    probs = torch.softmax(queries @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)  # [Hq, W, N]
    return probs.view(hkv, hq // hkv, w, n).mean(1).sum(1)[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[2]
    parser.add_argument("--inputs", type=Path, default=root / "tests" / "fixtures" / "kvpress_parity.pt")
    parser.add_argument("--out", type=Path, default=root / "tests" / "fixtures" / "kvpress_merge_parity.pt")
    args = parser.parse_args()

    from kvpress import CAMPress, KnormPress, MergingPress

    data = torch.load(args.inputs, weights_only=True)
    keys, values, queries = data["keys"].float(), data["values"].float(), data["queries"].float()
    layers, hkv, n, d = keys.shape
    out: dict = {"merging": {}, "cam": {}, "meta": {"kvpress": md.version("kvpress"), "torch": str(torch.__version__),
                                                   "inputs": args.inputs.name, "kept": KEPT}}
    for layer in range(layers):
        module = SimpleNamespace(layer_idx=0, head_dim=d)
        k, v = keys[layer : layer + 1], values[layer : layer + 1]
        for threshold, fraction in MERGING_SETTINGS:
            press = MergingPress(press=KnormPress(compression_ratio=1 - KEPT / n), similarity_threshold=threshold,
                                 merge_fraction=fraction)
            scores = press.press.score(module, None, k, v, None, {})
            kept = scores.topk(KEPT, dim=-1).indices
            _, merged = press.compress(module, None, k.clone(), v.clone(), None, {})
            out["merging"][(layer, threshold, fraction)] = {"kept": kept, "values": merged}
        attention = cumulative_attention(keys[layer], queries[layer])
        for budget in CAM_BUDGETS:
            press = CAMPress(base_press=KnormPress(), target_size=KEPT, compression_interval=n - KEPT,
                             merge_budget=budget)
            press.layer_step_counts[0] = n - KEPT
            press._running_attn_sum[0] = attention.clone()
            drawn: list[torch.Tensor] = []
            bernoulli = torch.bernoulli

            def recording(p, *a, _drawn=drawn, _bernoulli=bernoulli, **kw):
                m = _bernoulli(p, *a, **kw)
                _drawn.append((p.clone(), m.clone()))
                return m

            torch.manual_seed(0)
            torch.bernoulli = recording
            try:
                _, merged = press.compress(module, None, k.clone(), v.clone(), attention.clone(), {})
            finally:
                torch.bernoulli = bernoulli
            mean_scores = press.base_press.score(module, None, k, v, None, {}).mean(1)
            kept = mean_scores.topk(KEPT, dim=-1).indices.sort(-1).values
            evicted = mean_scores.topk(n - KEPT, dim=-1, largest=False).indices.sort(-1).values
            ((probability, mask),) = drawn
            out["cam"][(layer, budget)] = {"attention": attention, "kept": kept, "candidates": evicted,
                                           "probability": probability, "mask": mask, "values": merged}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
