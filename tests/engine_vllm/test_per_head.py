"""Per-head budgets served by vLLM: Ada-KV's heads keep counts of their own, decided from the
data at each eviction (``kvpolicy.vllm.paged_cache``: each head's slots at the front of its lane,
room reserved for the fullest head, attention over each head's own slots). The bundled
SmolLM2-135M (3 KV heads) with ``ada-vase-attnv`` at a budget that evicts several times: the
tokens equal the transformers path's (``KVPolicyCache`` + ``generate()``) but where both
engines' top-2 logits are within a rounding tie, and the worker's trace shows the heads keeping
different counts and the memory the requests hold against what their heads use.

Every eviction vLLM made is replayed from its saved inputs (``Policy.select_heads``: the same
slots and counts). The stochastic policy's choices move under a change of their inputs far below
the two engines' rounding differences (the test measures it), so for it a late divergence after
such evictions is not a disagreement; ``ada-snapkv`` (greedy) must give every token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, greedy, make_llm, read_jsonl, tokens_prompt, top2_gap  # noqa: E402

from kvpolicy import load_policy  # noqa: E402

BUDGET = 96
NEW = 256
BLOCK = 32
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
POLICY_NAMES = ["ada-vase-attnv", "ada-snapkv"]  # each served, and compared with generate(), at OVERRIDES
OVERRIDES = {"budget": BUDGET, "recent": 16, "interval": 32, "window": 32}
PROMPTS = [
    "Write a long story about a dragon who learns to code. Once upon a time",
    "List the numbers from one to two hundred: one, two, three,",
]


@pytest.fixture(scope="module")
def model_dir():
    from kvpolicy.vllm.models import smollm2_folder

    return smollm2_folder()


def hf_refs(model_dir, name):
    """``KVPolicyCache`` + ``generate()`` (computed before the engine starts: CPUs are few)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    rows = engine_util.hf_references(model, load_policy(name, **OVERRIDES), [tokenizer(text).input_ids for text in PROMPTS], NEW)
    del model
    return rows


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_per_head_budgets_give_generates_tokens(name, model_dir, tmp_path, monkeypatch):
    refs = hf_refs(model_dir, name)
    monkeypatch.setenv("KVPOLICY_VLLM_TRACE_SAVES", "1000")  # every eviction's inputs, read back below
    llm = make_llm(model_dir, {"policy": name, **OVERRIDES, "trace": str(tmp_path)}, block_size=BLOCK)
    try:
        outs = llm.generate([tokens_prompt(ids) for ids, _, _ in refs], greedy(NEW, logprobs=2), use_tqdm=False)
    finally:
        close(llm)
    # Every eviction kept exactly what the policy keeps on the same inputs (each head's own count).
    saved = sorted(tmp_path.glob("evict-*.pt"))
    flips = dict.fromkeys((1e-6, 1e-4), 0)  # evictions whose choice moves when the inputs move by that much
    for path in saved:
        rec = torch.load(path)
        policy = load_policy(rec["policy_yaml"])

        def select(scale: float, rec=rec, policy=policy) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(0)
            # (values are a meta placeholder where the policy reads none: Policy.reads_values)
            moved = [t if t.is_meta else t * (1 + scale * torch.randn(t.shape, generator=g))
                     for t in (rec["keys"], rec["values"], rec["queries"])]
            return policy.select_heads(*moved, slot_valid=rec["slot_valid"], query_valid=rec["query_valid"],
                                       positions=rec["positions"], layer_idx=rec["layer_idx"],
                                       evictions=rec["evictions"], seed=rec["seed"])

        keep, counts = select(0.0)
        assert torch.equal(keep, rec["kept"]) and torch.equal(counts, rec["head_counts"]), path.name
        for scale in flips:
            flips[scale] += not torch.equal(select(scale)[0], keep)
    agreed = []
    divergence = None
    for (ids, ref, margins), out in zip(refs, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        i = first_divergence(got, ref)
        agreed.append(NEW if i is None else i)
        if i is None:
            continue
        gap = top2_gap(out, i)
        if not (margins[i] < TIE or gap < TIE) and divergence is None:
            divergence = (f"prompt {ids[:8]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), "
                          f"{gap:.2e} (vllm)")
    records = read_jsonl(tmp_path, "worker-")
    per_request: dict[str, int] = {}
    uneven = 0
    held = useful = 0
    for rec in records:
        for req, counts in zip(rec["requests"], rec["head_counts"], strict=True):
            per_request[req] = per_request.get(req, 0) + 1
            flat = [c for layer in counts for c in layer]
            uneven += len(set(flat)) > 1
            held += rec["kept"] * len(flat)  # block-table slots every head of every layer holds room for
            useful += sum(flat)
    assert len(per_request) == len(PROMPTS) and min(per_request.values()) >= 3, per_request
    assert uneven == sum(per_request.values()), "some eviction kept the same count in every head"
    print(f"{name}: tokens agreed before any divergence: {agreed}; evictions per request: "
          f"{sorted(per_request.values())}; {len(saved)} evictions replayed, of which {flips} choose other slots "
          f"when their inputs move by that relative amount; slots held right after evictions {held}, of which the "
          f"heads' own {useful} ({useful / held:.1%})")
    # A divergence must be a rounding tie of the logits, or follow evictions whose choice a rounding-size
    # change of their inputs moves (measured above: Ada-KV's pooled Gumbel race is so sensitive), where the
    # two engines' different kernels decide them; every eviction is the policy's on vLLM's inputs (above).
    assert divergence is None or flips[1e-6] > 0, divergence
