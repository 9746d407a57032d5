"""``random-prompt`` served by vLLM: each request's prompt length reaches the workers (the
``prompt`` reservation reads vLLM's own ``num_prompt_tokens``), its greedy tokens equal
``KVPolicyCache`` + ``generate()`` as far as the two engines agree without eviction, and a request
whose prompt its budget cannot hold is refused before it runs, alone."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, greedy, make_llm, tokens_prompt  # noqa: E402

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder  # noqa: E402

NEW = 160
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
SHORT = "Write a long story about a dragon who learns to code. Once upon a time"
LONG = "Explain in detail how a steam engine works, step by step. " * 8  # longer than the small budget
CASES = {"small": ({"policy": "random-prompt", "budget": 64, "interval": 16}, SHORT),
         "large": ({"policy": "random-prompt", "budget": 160, "interval": 16, "seed": 3}, LONG)}


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_folder()


@pytest.fixture(scope="module")
def refs(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    out = {}
    for name, (settings, text) in CASES.items():
        policy = load_policy(settings["policy"], **{k: v for k, v in settings.items() if k != "policy"})
        out[name] = engine_util.hf_references(model, policy, [tokenizer(text).input_ids], NEW)[0]
    del model
    return out


def test_served_as_generate_and_a_prompt_too_long_for_the_budget_is_refused(model_dir, refs, tmp_path):
    trace = tmp_path / "trace"
    llm = make_llm(model_dir, {"policy": "none", "trace": str(trace)})
    try:
        names = list(CASES)
        params = [greedy(NEW, logprobs=2, extra_args={"kvpolicy": CASES[n][0]}) for n in names]
        outs = llm.generate([tokens_prompt(refs[n][0]) for n in names], params, use_tqdm=False)
        for name, out in zip(names, outs, strict=True):
            ids, ref, margins = refs[name]
            got = list(out.outputs[0].token_ids)
            assert len(got) == NEW
            i = first_divergence(got, ref)
            if i is not None:
                lp = sorted((x.logprob for x in out.outputs[0].logprobs[i].values()), reverse=True)
                gap = lp[0] - lp[1] if len(lp) > 1 else float("inf")
                assert margins[i] < TIE or gap < TIE, f"{name}: first divergence at token {i}"
        long_ids = refs["large"][0]
        assert len(long_ids) > 64
        with pytest.raises(Exception, match=rf"prompt of {len(long_ids)} tokens does not fit the 64 slots"):
            llm.generate([tokens_prompt(long_ids)], greedy(NEW, extra_args={"kvpolicy": CASES["small"][0]}),
                         use_tqdm=False)
        out = llm.generate([tokens_prompt(refs["small"][0])], greedy(8, extra_args={"kvpolicy": CASES["small"][0]}),
                           use_tqdm=False)  # still serving
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        close(llm)
    assert list(trace.glob("worker-*.jsonl")), "the plugin did not evict"
