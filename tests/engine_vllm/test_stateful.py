"""Policies whose stages keep state, served by vLLM: each request's state moves with its slots
through compaction, sees every query (long prompt chunks layer by layer, the window before unseen
queries would leave it), and the tokens equal ``KVPolicyCache`` + ``generate()`` as far as the two
engines agree without eviction; with prefix caching on too (a request whose state must see every
query computes its whole prompt)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, greedy, make_llm, tokens_prompt  # noqa: E402

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder  # noqa: E402

BUDGET = 128
NEW = 128
PROMPTS = [
    "Write a long story about a dragon who learns to code. Once upon a time",
    # longer than every window: the prompt's queries reach the state layer by layer, in chunks
    "Explain in detail how a steam engine works, step by step. " * 12,
]
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
H2O_W16 = "name: h2o-w16\nschedule: {budget: 128, recent: 64, interval: 64, window: 16}\n" \
          "scorer: {type: accumulated_attention}\nselector: {type: greedy}\n"


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_folder()


def reference_policies() -> dict:
    """The policies whose ``generate()`` references this module compares with, by name."""
    return {"h2o": load_policy("h2o", budget=BUDGET), "h2o-w16": load_policy(H2O_W16),
            "gkv": load_policy("gkv", budget=BUDGET), "gkv-b64": load_policy("gkv", budget=64, interval=16)}


@pytest.fixture(scope="module")
def refs(model_dir):
    """``KVPolicyCache`` + ``generate()`` per policy (computed before any engine starts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    ids = [tokenizer(text).input_ids for text in PROMPTS]
    out = {name: engine_util.hf_references(model, policy, ids, NEW) for name, policy in reference_policies().items()}
    del model
    return out


def _requests():
    return {"h2o": None, "h2o-w16": {"kvpolicy": {"policy": H2O_W16}},
            "gkv": {"kvpolicy": {"policy": "gkv", "budget": BUDGET}},
            # evicts at every 16th token: the worker once updated G-KV's state twice per eviction,
            # and its tokens left generate()'s after about a hundred (the runs above evict at most once)
            "gkv-b64": {"kvpolicy": {"policy": "gkv", "budget": 64, "interval": 16}}}


def _check(llm, refs, requests) -> None:
    names = list(requests)
    prompts, params, expected = [], [], []
    for name in names:
        for ids, tokens, margins in refs[name]:
            prompts.append(tokens_prompt(ids))
            params.append(greedy(NEW, logprobs=2, **({} if requests[name] is None else {"extra_args": requests[name]})))
            expected.append((name, ids, tokens, margins))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (name, ids, ref, margins), out in zip(expected, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        i = first_divergence(got, ref)
        if i is None:
            continue
        lp = sorted((x.logprob for x in out.outputs[0].logprobs[i].values()), reverse=True)
        gap = lp[0] - lp[1] if len(lp) > 1 else float("inf")
        assert margins[i] < TIE or gap < TIE, (
            f"{name}, prompt {ids[:6]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), "
            f"{gap:.2e} (vllm)")


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_stateful_policies_equal_generate(model_dir, refs, tmp_path, prefix_caching):
    trace = tmp_path / "trace"
    llm = make_llm(model_dir, {"policy": "h2o", "budget": BUDGET, "trace": str(trace)},
                   enable_prefix_caching=prefix_caching)
    try:
        requests = _requests()
        _check(llm, refs, requests)
        if prefix_caching:  # the same prompts again: cached prefixes exist now, stateful requests compute theirs
            _check(llm, refs, requests)
    finally:
        close(llm)
    assert list(trace.glob("worker-*.jsonl")), "the plugin did not evict"
