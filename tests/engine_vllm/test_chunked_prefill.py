"""A prompt prefilled in chunks evicts as a prompt in one step does (``kvpolicy.schedule.step_phase``,
the one prompt rule of the caches and vLLM's ledger).

The bundled SmolLM2-135M in float32, greedy, prompts of at least 900 tokens that vLLM prefills in
chunks of 256 (``max_num_batched_tokens=256``), then 64 new tokens at a budget of 128, so every
request evicts several times (every 16 tokens, four times): the tokens equal the
transformers path's (``KVPolicyCache`` + ``generate()``, the prompt in one step) but where both
engines' top-2 logits are within a rounding tie. One engine, with a KV-cache group per layer,
serves ``pyramidkv`` (the server's policy) and ``snapkv``, ``h2o`` and ``vase-attnv`` per
request; ``quest`` at block pages, which per-layer groups refuse, is checked the same way on the
select-mode engine (``test_select.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, greedy, make_llm, tokens_prompt, top2_gap  # noqa: E402

from kvpolicy import load_policy  # noqa: E402

NEW = 64
BLOCK = 32
CHUNK = 256
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
OVERRIDES = {"budget": 128, "recent": 16, "interval": 16, "window": 16}


POLICIES = {name: {"policy": name, **OVERRIDES} for name in ("pyramidkv", "snapkv", "h2o", "vase-attnv")}


@pytest.fixture(scope="module")
def model_dir():
    from kvpolicy.vllm.models import smollm2_folder

    return smollm2_folder()


#: Two prompts of real English, 900 and 1,000 tokens of SmolLM2's tokenizer (the built-in policies'
#: descriptions, frozen: an edited description must not change what the engine tests run).
LONG_PROMPTS = Path(__file__).parents[1] / "fixtures" / "long_prompts.json"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    data = json.loads(LONG_PROMPTS.read_text())["prompts"]
    assert [len(p) for p in data] == [900, 1000]
    return data


def hf_rows(model_dir, jobs):
    """``KVPolicyCache`` + ``generate()`` for (policy source, prompt ids) pairs, before any engine
    starts (CPUs are few): prompt ids, tokens, and each step's top-2 logit gap. A policy's prompts
    decode as one batch."""
    model = engine_util.hf_model(model_dir)
    by_source: dict[str, list[list[int]]] = {}
    for source, ids in jobs:
        by_source.setdefault(json.dumps(source, sort_keys=True), []).append(ids)
    done: dict[str, list] = {}
    for key, prompts in by_source.items():
        source = json.loads(key)
        policy = load_policy(source["policy"], **{k: v for k, v in source.items() if k != "policy"})
        done[key] = engine_util.hf_references(model, policy, prompts, NEW)
    del model
    return [done[json.dumps(source, sort_keys=True)].pop(0) for source, _ in jobs]


def agreed_with_generate(rows, outs, names) -> dict[str, int]:
    """Tokens of each request equal to ``generate()``'s before the first difference, failing on a
    difference that is not a rounding tie of the top-2 logits in either engine."""
    agreed = {}
    for (ids, ref, margins), out, name in zip(rows, outs, names, strict=True):
        i = first_divergence(list(out.outputs[0].token_ids), ref)
        agreed[name] = NEW if i is None else i
        if i is not None:
            gap = top2_gap(out, i)
            assert margins[i] < TIE or gap < TIE, (
                f"{name}, prompt of {len(ids)}: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), "
                f"{gap:.2e} (vllm)")
    return agreed


def serve(model_dir, server_policy, jobs, names):
    llm = make_llm(model_dir, {"policy": server_policy, **OVERRIDES}, block_size=BLOCK, enable_chunked_prefill=True,
                   max_num_batched_tokens=CHUNK)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == CHUNK
        params = [greedy(NEW, logprobs=2, extra_args={"kvpolicy": source}) for source, _ in jobs]
        return llm.generate([tokens_prompt(ids) for _, ids in jobs], params, use_tqdm=False)
    finally:
        close(llm)


def test_prompts_prefilled_in_chunks_of_256_give_generates_tokens(model_dir, prompts):
    jobs = [(source, ids) for source in POLICIES.values() for ids in prompts]
    names = [f"{name}@{len(ids)}" for name in POLICIES for ids in prompts]
    rows = hf_rows(model_dir, jobs)
    agreed = agreed_with_generate(rows, serve(model_dir, "pyramidkv", jobs, names), names)
    # A rounding tie may end the comparison early, never before the first evictions.
    assert sum(agreed.values()) >= 0.9 * NEW * len(names), agreed
