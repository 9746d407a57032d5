"""Select mode served by vLLM (``kvpolicy.vllm.select``): the bundled SmolLM2-135M, one engine
(server policy ``none``) whose requests name their own select-mode policy: Quest at page
granularity over vLLM's blocks of 32 (pages of 32 slots), and the shipped ``quest`` (slot
granularity, pages of 16), each at budget 128 over prompts plus 256 new tokens. Their tokens
equal ``KVPolicyCache`` + ``generate()`` with the same policy, but where both engines' top-2
logits are within a rounding tie; the selection changes the tokens (they differ from the full
cache's), so the engine did attend the chosen blocks. A page choice whose pages are not the
blocks is refused for that request alone, by name. The engine prefills in chunks of 256
(``max_num_batched_tokens``): two prompts of 900 and 1,000 tokens under Quest at block pages
attend as their one-step prompts do in ``generate()`` (``kvpolicy.schedule.step_phase``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import engine_util  # noqa: E402
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
CHUNK = 256  # the engine's max_num_batched_tokens: longer prompts are prefilled in chunks
LONG_NEW = 40  # new tokens after the long prompts (select mode chooses at each of them)


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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    ids = [tokenizer(text).input_ids for text in PROMPTS]
    refs = {name: engine_util.hf_references(model, None if source is None else load_policy(source), ids, NEW)
            for name, source in POLICIES.items()}
    quest_pages = load_policy(POLICIES["quest-pages"])
    refs["quest-pages@long"] = engine_util.hf_references(model, quest_pages, long_prompts(tokenizer), LONG_NEW)
    del model
    return refs


def long_prompts(tokenizer) -> list[list[int]]:
    """Two prompts of real English, 900 and 1,000 tokens, frozen (``test_chunked_prefill.LONG_PROMPTS``)."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "fixtures" / "long_prompts.json").read_text())["prompts"]


def test_select_mode_tokens_equal_generates_and_a_page_size_not_the_blocks_is_refused(model_dir, hf_refs):
    from vllm.exceptions import VLLMValidationError

    llm = make_llm(model_dir, {"policy": "none"}, block_size=BLOCK, enable_chunked_prefill=True,
                   max_num_batched_tokens=CHUNK)
    try:
        prompts, params, names = [], [], []
        for name, source in POLICIES.items():
            extra = {"kvpolicy": "none" if source is None else {"policy": source}}
            for ids, _, _ in hf_refs[name]:
                prompts.append(tokens_prompt(ids))
                params.append(greedy(NEW, logprobs=2, extra_args=extra))
                names.append(name)
        for ids, _, _ in hf_refs["quest-pages@long"]:  # prefilled in chunks
            prompts.append(tokens_prompt(ids))
            params.append(greedy(LONG_NEW, logprobs=2, extra_args={"kvpolicy": {"policy": POLICIES["quest-pages"]}}))
            names.append("quest-pages@long")
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
    for name in [*POLICIES, "quest-pages@long"]:
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
            if name not in ("none", "quest-pages@long") and ref != full[1]:
                changed += 1
                print(f"{name}, prompt {ids[:6]}: differs from the full cache from token {first_divergence(ref, full[1])}"
                      f", vLLM equals generate() {'throughout' if i is None else f'up to token {i}'}")
    assert changed >= 2, "selection at budget 128 changed no prompt's tokens: nothing shows it was attended"


PREEMPT_POOL = 12  # blocks of 32: 352 usable slots, less than the three requests' 3 x 300 tokens


def _preemption_workload():
    import random

    from vllm import SamplingParams

    rng = random.Random(7)
    shared = [rng.randint(3, 4000) for _ in range(32)]  # a block every prompt starts with
    sources = [_quest_pages(recent=32), load_policy("quest", budget=64, recent=16).config.to_dict(),
               load_policy("oracle-topk", budget=64, recent=16).config.to_dict()]
    out = []
    for i, source in enumerate(sources):
        ids = shared + [rng.randint(3, 4000) for _ in range(8)]
        params = SamplingParams(max_tokens=260, min_tokens=260, ignore_eos=True, temperature=0.0,
                                extra_args={"kvpolicy": {"policy": source}})
        out.append((f"select-{i}", ids, params))
    return out


def _run_alone_or_loaded(llm, work, loaded: bool) -> dict[str, list[int]]:
    eng = llm.llm_engine
    done: dict[str, list[int]] = {}
    batches = [work] if loaded else [[w] for w in work]
    step = 0
    for batch in batches:
        for rid, ids, params in batch:
            eng.add_request(rid, tokens_prompt(ids), params)
        while eng.has_unfinished_requests():
            if loaded and step % 100 == 60:  # vLLM preempts every running request
                assert eng.reset_prefix_cache(reset_running_requests=True)
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            step += 1
    return done


def test_select_requests_preempted_while_selecting_equal_their_runs_alone(tmp_path):
    """The tiny random Qwen3, prefix caching on, three select-mode requests (Quest by pages of 32,
    the shipped quest, oracle-topk) of 300 tokens over a pool of 12 blocks: vLLM preempts them as
    they grow, and every 100 steps preempts every running one, after they started selecting.
    Recomputed one token per step past their budget (the scheduler's cap), each gives exactly its
    tokens alone on an idle engine with a large pool."""
    from engine_util import read_jsonl

    from kvpolicy.vllm.models import tiny_qwen3_folder

    work = _preemption_workload()
    got = {}
    for name, blocks in (("alone", None), ("loaded", PREEMPT_POOL)):
        trace = tmp_path / name
        kwargs = {} if blocks is None else {"num_gpu_blocks_override": blocks}
        # vLLM's processes, as this workload was tuned on: its engine core steps on its own while
        # this loop counts the outputs it reads. An engine in this process runs exactly one step per
        # loop, and a preemption every 100 of them comes before the recomputes (one token per step
        # past the budget) finish: its requests never did (37,000 steps, seen on 6 December 2026).
        llm = make_llm(tiny_qwen3_folder(), {"policy": "none", "trace": str(trace)}, block_size=BLOCK,
                       max_model_len=320, enable_prefix_caching=True, processes=True, **kwargs)
        try:
            got[name] = _run_alone_or_loaded(llm, work, loaded=blocks is not None)
        finally:
            close(llm)
    steps = read_jsonl(tmp_path / "loaded", "scheduler-")
    print(f"recompute steps cut to one token: {steps[-1]['replay_cuts_total']}; peak blocks in use "
          f"{max(s['held_blocks'] for s in steps)} of {steps[-1]['total_blocks']}")
    for rid, *_ in work:
        assert got["loaded"][rid] == got["alone"][rid], (
            f"{rid}: first divergence at {first_divergence(got['loaded'][rid], got['alone'][rid])}")
    assert steps[-1]["replay_cuts_total"] > 0, "no select-mode request was recomputed past its budget"
    assert steps[-1]["held_blocks"] == 0


def _written_cache(blocks: int, kv_heads: int, d: int):
    """A CPU-backend layer cache of ``blocks`` blocks filled with random keys and values by the
    backend's own cache write, and ``block_kernel.CpuBlocks`` over it."""
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicy.vllm.block_kernel import CpuBlocks

    cache = torch.zeros(blocks, kv_heads, BLOCK, 2 * d)
    key_cache, value_cache = cache.view(blocks, kv_heads, 2 * BLOCK, d).chunk(2, dim=2)
    isa = _get_attn_isa(torch.float32, BLOCK, d)
    ops.cpu_attn_reshape_and_cache(torch.randn(blocks * BLOCK, kv_heads, d), torch.randn(blocks * BLOCK, kv_heads, d),
                                   key_cache, value_cache, torch.arange(blocks * BLOCK), isa)
    impl = SimpleNamespace(logits_soft_cap=0, alibi_slopes=None, sinks=None, kv_cache_dtype="auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    return cache, CpuBlocks(impl, layer, cache)


@pytest.mark.parametrize("length", [1, 70, 5 * BLOCK])
def test_the_cpu_kernel_attends_each_heads_own_blocks_as_the_gathering_path_does(length):
    """``block_kernel.CpuBlocks`` (vLLM's CPU kernel, one sequence per request and KV head over
    the cache viewed block-and-head by block-and-head) equals ``select.gathered_blocks`` (the
    blocks gathered through ``BlockLayout.split`` and ``kvpolicy.attend``) on keys written by the
    backend's own cache write, each head reading blocks of its own, the last one partial."""
    from kvpolicy.vllm.layout import BlockLayout
    from kvpolicy.vllm.select import gathered_blocks

    torch.manual_seed(0)
    blocks, kv_heads, d, q_heads, r, m = 40, 3, 64, 9, 2, 5
    cache, kernel = _written_cache(blocks, kv_heads, d)
    ids = torch.stack([torch.stack([torch.randperm(blocks)[:m] for _ in range(kv_heads)]) for _ in range(r)])
    query = torch.randn(r, q_heads, d)
    got = kernel(query, ids, length, d**-0.5)
    want = gathered_blocks(BlockLayout.for_backend("CPU_ATTN", "LBHNC", d).split(cache))(query, ids, length, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, :3], got[:, 3:6], atol=1e-3)  # the heads read other blocks


def test_the_cpu_kernel_attends_each_heads_own_count_of_slots():
    """Per-head budgets (``lanes.attend`` at a decode step): ``CpuBlocks`` given a count of slots per request
    and KV head reads each head's own first slots of its blocks, as an attention written here
    over exactly those slots, read through ``BlockLayout.split``, does; counts of 1, a partial
    block and whole blocks."""
    from kvpolicy.vllm.layout import BlockLayout

    torch.manual_seed(1)
    blocks, kv_heads, d, q_heads, r, m = 30, 3, 64, 9, 2, 4
    cache, kernel = _written_cache(blocks, kv_heads, d)
    table = torch.stack([torch.randperm(blocks)[:m] for _ in range(r)])  # a request's blocks, every head's lane
    lengths = torch.tensor([[1, 45, 4 * BLOCK], [BLOCK, 7, 100]], dtype=torch.int32)
    query = torch.randn(r, q_heads, d)
    got = kernel(query, table[:, None].expand(-1, kv_heads, -1), lengths, d**-0.5)
    keys, values = BlockLayout.for_backend("CPU_ATTN", "LBHNC", d).split(cache)  # [blocks, BLOCK, Hkv, D]
    g = q_heads // kv_heads
    for i in range(r):
        for h in range(kv_heads):
            n = int(lengths[i, h])
            k, v = keys[table[i], :, h].flatten(0, 1)[:n], values[table[i], :, h].flatten(0, 1)[:n]
            q = query[i, h * g : (h + 1) * g]
            want = torch.softmax(q @ k.T * d**-0.5, dim=-1) @ v
            torch.testing.assert_close(got[i, h * g : (h + 1) * g], want, rtol=1e-5, atol=1e-5)


def test_a_kernel_attribute_vllm_renamed_is_refused_by_name():
    """``block_kernel.check`` (run at start-up for every layer on the CPU backend): a layer
    without the attribute the kernel call reads is refused naming it, not served without it."""
    from types import SimpleNamespace

    from kvpolicy.vllm.block_kernel import check
    from kvpolicy.vllm.support import KVPolicyVLLMError

    impl = SimpleNamespace(kv_cache_dtype="auto", logits_soft_cap=0)
    with pytest.raises(KVPolicyVLLMError, match="'isa'"):
        check(impl, SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0))  # the ISA renamed away
