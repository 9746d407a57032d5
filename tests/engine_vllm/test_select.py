"""Select mode served by vLLM (``kvpolicy.vllm.select``): the bundled SmolLM2-135M, one engine
(server policy ``none``) whose requests name their own select-mode policy: Quest at page
granularity over vLLM's blocks of 32 (pages of 32 slots), and the shipped ``quest`` (slot
granularity, pages of 16), each at budget 128 over prompts plus 256 new tokens. Their tokens
equal ``KVPolicyCache`` + ``generate()`` with the same policy, but where both engines' top-2
logits are within a rounding tie; the selection changes the tokens (they differ from the full
cache's), so the engine did attend the chosen blocks. A page choice whose pages are not the
blocks is refused for that request alone, by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_util import close, first_divergence, greedy, make_llm, tokens_prompt  # noqa: E402

from kvpolicy import load_policy  # noqa: E402

BUDGET = 128
NEW = 256
BLOCK = 32
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
PROMPTS = [
    "Write a long story about a dragon who learns to code. Once upon a time",
    "List the numbers from one to two hundred: one, two, three,",
]


def _quest_pages(page: int = BLOCK, recent: int = 32) -> dict:
    """The shipped quest at page granularity, pages of ``page`` slots (a policy mapping)."""
    data = load_policy("quest", budget=BUDGET, recent=recent).config.to_dict()
    return {**data, "name": "quest-pages", "scorer": {**data["scorer"], "page_size": page, "granularity": "page"}}


POLICIES = {
    "quest-pages": _quest_pages(),
    "quest": load_policy("quest", budget=BUDGET, recent=16).config.to_dict(),
    "none": None,
}


@pytest.fixture(scope="module")
def model_dir():
    from kvpolicy.vllm.models import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="module")
def hf_refs(model_dir):
    """``KVPolicyCache`` + ``generate()`` per policy and prompt (the full cache for ``none``),
    computed before the engine starts: CPUs are few."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpolicy import KVPolicyCache

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = {}
    for name, source in POLICIES.items():
        rows = []
        for text in PROMPTS:
            ids = tokenizer(text).input_ids
            x = torch.tensor([ids])
            cache = {} if source is None else {"past_key_values": KVPolicyCache(load_policy(source), model)}
            with torch.no_grad():
                g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False, output_logits=True, return_dict_in_generate=True, **cache)
            top2 = [lg[0].float().topk(2).values for lg in g.logits]
            rows.append((ids, g.sequences[0, len(ids):].tolist(), [float(t[0] - t[1]) for t in top2]))
        refs[name] = rows
    del model
    return refs


def test_select_mode_tokens_equal_generates_and_a_page_size_not_the_blocks_is_refused(model_dir, hf_refs):
    from vllm.exceptions import VLLMValidationError

    llm = make_llm(model_dir, {"policy": "none"}, block_size=BLOCK)
    try:
        prompts, params, names = [], [], []
        for name, source in POLICIES.items():
            extra = {"kvpolicy": "none" if source is None else {"policy": source}}
            for ids, _, _ in hf_refs[name]:
                prompts.append(tokens_prompt(ids))
                params.append(greedy(NEW, logprobs=2, extra_args=extra))
                names.append(name)
        outs = llm.generate(prompts, params, use_tqdm=False)  # every policy in one batch
        with pytest.raises(VLLMValidationError, match="chooses pages of 16 slots .* blocks hold 32"):
            llm.generate([tokens_prompt(hf_refs["none"][0][0])],
                         greedy(8, extra_args={"kvpolicy": {"policy": _quest_pages(page=16, recent=16)}}),
                         use_tqdm=False)
        after = llm.generate([tokens_prompt(hf_refs["none"][0][0])], greedy(8), use_tqdm=False)
        assert len(after[0].outputs[0].token_ids) == 8  # the engine goes on serving
    finally:
        close(llm)
    got = {}
    for name, out in zip(names, outs, strict=True):
        got.setdefault(name, []).append(out)
    changed = 0
    for name in POLICIES:
        for (ids, ref, margins), out, full in zip(hf_refs[name], got[name], hf_refs["none"], strict=True):
            tokens = list(out.outputs[0].token_ids)
            i = first_divergence(tokens, ref)
            if i is not None:
                lp = sorted((x.logprob for x in out.outputs[0].logprobs[i].values()), reverse=True)
                gap = lp[0] - lp[1] if len(lp) > 1 else float("inf")
                assert margins[i] < TIE or gap < TIE, (
                    f"{name}, prompt {ids[:8]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} "
                    f"(hf), {gap:.2e} (vllm)"
                )
            if name != "none" and ref != full[1]:
                changed += 1
                print(f"{name}, prompt {ids[:6]}: differs from the full cache from token {first_divergence(ref, full[1])}"
                      f", vLLM equals generate() {'throughout' if i is None else f'up to token {i}'}")
    assert changed >= 2, "selection at budget 128 changed no prompt's tokens: nothing shows it was attended"
