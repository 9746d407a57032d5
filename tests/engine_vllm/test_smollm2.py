"""The bundled SmolLM2-135M in float32, greedy: exactness without eviction, and parity with the
transformers path (``KVPolicyCache`` + ``generate()``) for snapkv and streamingllm at budget 128."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, generate_in_subprocess, greedy, make_llm, tokens_prompt  # noqa: E402

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder  # noqa: E402

BUDGET = 128
NEW = 256
PROMPTS = [
    "Write a long story about a dragon who learns to code. Once upon a time",
    "Explain in detail how a steam engine works, step by step.",
    "List the numbers from one to two hundred: one, two, three,",
]
SHORT = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are", "Hello, my name is"]
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
# Small blocks: budget 128 spans 4 blocks, an eviction at 192 slots compacts across 6 and frees 2.
BLOCK = 32
REFERENCE_POLICIES = ("snapkv", "streamingllm")  # compared with generate() at BUDGET


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_folder()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_refs(model_dir, tokenizer):
    """``KVPolicyCache`` + ``generate()`` (computed before any engine starts: CPUs are few)."""
    model = engine_util.hf_model(model_dir)
    ids = [tokenizer(text).input_ids for text in PROMPTS]
    refs = {name: engine_util.hf_references(model, load_policy(name, budget=BUDGET), ids, NEW)
            for name in REFERENCE_POLICIES}
    del model
    return refs


def _parity(llm, rows):
    outs = llm.generate([tokens_prompt(ids) for ids, _, _ in rows], greedy(NEW, logprobs=2), use_tqdm=False)
    for (ids, ref, margins), out in zip(rows, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        i = first_divergence(got, ref)
        if i is None:
            continue
        # Only a rounding tie may split the two paths: shown by both engines' top-2 gaps.
        vllm_lp = sorted((x.logprob for x in out.outputs[0].logprobs[i].values()), reverse=True)
        gap = vllm_lp[0] - vllm_lp[1] if len(vllm_lp) > 1 else float("inf")
        assert margins[i] < TIE or gap < TIE, (
            f"prompt {ids[:8]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), {gap:.2e} (vllm)"
        )


def test_snapkv_exact_without_eviction_and_parity(model_dir, tokenizer, hf_refs, tmp_path):
    short_ids = [tokenizer(t).input_ids for t in SHORT]
    short = [tokens_prompt(ids) for ids in short_ids]
    expected = _without_plugin(model_dir, short_ids, tmp_path)
    llm = make_llm(model_dir, {"policy": "snapkv", "budget": BUDGET, "trace": str(tmp_path)}, block_size=BLOCK)
    try:
        # Prompt + 100 tokens stay under the budget: no eviction, identical tokens.
        got = [list(o.outputs[0].token_ids) for o in llm.generate(short, greedy(100), use_tqdm=False)]
        assert got == expected
        assert not list(tmp_path.glob("worker-*.jsonl"))
        _parity(llm, hf_refs["snapkv"])
        assert list(tmp_path.glob("worker-*.jsonl")), "the plugin did not evict"
    finally:
        close(llm)
    # The slots kept at each traced eviction are Policy.select on the same keys, values, queries.
    saved = sorted(tmp_path.glob("evict-*.pt"))
    assert saved
    for path in saved:
        rec = torch.load(path)
        policy = load_policy(rec["policy_yaml"])
        kept = policy.select(
            rec["keys"], rec["values"], rec["queries"], query_valid=rec["query_valid"], positions=rec["positions"],
            layer_idx=rec["layer_idx"], evictions=rec["evictions"], seed=rec["seed"],
        )
        assert torch.equal(kept, rec["kept"])
        assert rec["keys"].shape[2] == BUDGET + 64 and kept.shape[-1] == BUDGET


def test_streamingllm_parity(model_dir, hf_refs, tmp_path):
    llm = make_llm(model_dir, {"policy": "streamingllm", "budget": BUDGET, "trace": str(tmp_path)}, block_size=BLOCK)
    try:
        _parity(llm, hf_refs["streamingllm"])
    finally:
        close(llm)
    assert list(tmp_path.glob("worker-*.jsonl")), "the plugin did not evict"


def _without_plugin(model_dir, prompts, tmp_path):
    """The same vLLM with kvpolicy not loaded at all (``VLLM_PLUGINS=none``)."""
    return generate_in_subprocess(tmp_path, model_dir, prompts, 100, env={"VLLM_PLUGINS": "none"}, block_size=BLOCK)
