"""What a server admits: a KV pool sized for the policy, not for max_model_len; requests that
cannot fit it, or that reach the engine with settings the front end did not resolve, fail alone.

Tiny random Qwen3, block size 32, max_model_len 2048. The small pool has 6 blocks (5 usable:
160 slots, a thirteenth of max_model_len); under snapkv at budget 32 a request never holds more
than 48 slots (2 blocks), whatever its length.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402
    close,
    first_divergence,
    greedy,
    make_llm,
    read_jsonl,
    serve_beside_a_refused_request,
    tokens_prompt,
)

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

BLOCK = 32
POLICY = {"policy": "snapkv", "budget": 32, "recent": 16, "interval": 16, "window": 16}


def _requests():
    rng = random.Random(21)
    return [([rng.randint(3, 4000) for _ in range(rng.randint(40, 90))], rng.randint(480, 560)) for _ in range(6)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace")
    # vLLM's own processes: this engine outlives the ones the module's tests start beside it
    llm = make_llm(tiny_qwen3_folder(), {**POLICY, "trace": str(trace)}, block_size=BLOCK,
                   num_gpu_blocks_override=6, max_num_seqs=8, processes=True)
    yield llm, trace
    close(llm)


def test_a_pool_of_a_few_budgets_serves_requests_longer_than_itself_with_preemptions(small):
    llm, trace = small
    reqs = _requests()
    prompts, params = [tokens_prompt(ids) for ids, _ in reqs], [greedy(n) for _, n in reqs]
    # vLLM admits a request when its peak (2-3 blocks here) fits, so these never outgrow the pool;
    # preemptions on the way come from vLLM preempting every running request every 150 steps.
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    done: dict[str, list[int]] = {}
    step = 0
    while eng.has_unfinished_requests():
        if step % 150 == 149:
            assert eng.reset_prefix_cache(reset_running_requests=True)
        for out in eng.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
        step += 1
    got = [done[f"r{i}"] for i in range(len(reqs))]
    steps = read_jsonl(trace, "scheduler-")
    assert steps[-1]["total_blocks"] == 5
    assert all(len(ids) + n > 5 * BLOCK for ids, n in reqs)  # every request is longer than the pool
    assert steps[-1]["preempted_after_evicting_total"] >= len(reqs)
    assert max(s["held_blocks"] for s in steps) <= 5
    assert steps[-1]["held_blocks"] == 0 and steps[-1]["free_blocks"] == 5
    big = make_llm(tiny_qwen3_folder(), POLICY, block_size=BLOCK, max_num_seqs=8)
    try:
        expected = [list(o.outputs[0].token_ids) for o in big.generate(prompts, params, use_tqdm=False)]
    finally:
        close(big)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == b, f"request {i}: first divergence at {first_divergence(a, b)}"


def test_a_request_that_cannot_fit_the_pool_is_refused_alone(small):
    from vllm.exceptions import VLLMValidationError

    llm, _ = small
    for extra, ids, message in (
        ({"kvpolicy": "none"}, list(range(10, 110)), r"needs 7 KV blocks of 32 \(no eviction"),
        (None, list(range(10, 210)), "its prompt of 200 tokens is held whole"),
    ):
        with pytest.raises(VLLMValidationError, match=message):
            llm.generate([tokens_prompt(ids)], greedy(100, extra_args=extra), use_tqdm=False)
    out = llm.generate([tokens_prompt(list(range(10, 40)))], greedy(400), use_tqdm=False)  # still serving
    assert len(out[0].outputs[0].token_ids) == 400


def test_unresolved_settings_that_bypass_the_front_end_fail_that_request_alone(small):
    """An ``EngineCoreRequest`` handed to the engine directly skips ``process_inputs``, where
    kvpolicy resolves a request's settings: the engine core refuses it, alone, and goes on."""
    llm, _ = small
    eng = llm.llm_engine
    good_ids = list(range(100, 140))
    eng.add_request("good", tokens_prompt(good_ids), greedy(120))
    bad = eng.input_processor.process_inputs("bad", tokens_prompt(list(range(10, 40))), greedy(8),
                                             supported_tasks=eng.get_supported_tasks())
    bad.sampling_params.extra_args = {"kvpolicy": "snapkv"}  # as a client that bypassed the front end
    eng.add_request("bad", bad, bad.sampling_params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = out
    assert done["bad"].outputs[0].finish_reason == "error" and not done["bad"].outputs[0].token_ids
    assert len(done["good"].outputs[0].token_ids) == 120
    # (The engine core logs kvpolicy's reason, "... the front end did not resolve ...": its
    # message is tested in tests/test_vllm_settings.py; this engine's log is not captured here.)
    out = llm.generate([tokens_prompt(list(range(10, 40)))], greedy(8), use_tqdm=False)  # still serving
    assert len(out[0].outputs[0].token_ids) == 8


def test_vllm_alone_refuses_the_same_pool_at_start_up(capfd):
    """The same pool with the policy ``none`` (no eviction): vLLM's own check, for one request of
    max_model_len tokens, refuses it (in the engine core, whose log says why)."""
    with pytest.raises(Exception):  # noqa: B017  (the front end reports a failed engine start)
        # in an engine-core process of its own: a start that fails there leaves this process as it was
        make_llm(tiny_qwen3_folder(), {"policy": "none"}, block_size=BLOCK, num_gpu_blocks_override=6, processes=True)
    logged = capfd.readouterr()
    assert "To serve at least one request with the model's max seq len (2048)" in logged.err + logged.out


def test_a_pool_too_small_for_a_first_evictions_fresh_blocks_is_refused_at_start_up(capfd):
    """Under prefix caching a request's first eviction writes its kept slots into fresh blocks
    beside its old ones, so on a short max_model_len a request holds more than max_model_len
    tokens' blocks: snapkv at budget 96 (interval 64), max_model_len 160, a request of 160 tokens
    holds 7 blocks of 32. The engine core asks vLLM's pool for that peak, and 6 blocks (5 usable),
    enough for max_model_len, are refused at start-up by name (until 7 December 2026 the server
    started, then refused such requests one by one)."""
    with pytest.raises(Exception):  # noqa: B017  (the front end reports a failed engine start)
        make_llm(tiny_qwen3_folder(), {"policy": "snapkv", "budget": 96}, block_size=BLOCK, max_model_len=160,
                 enable_prefix_caching=True, num_gpu_blocks_override=6, processes=True)
    logged = capfd.readouterr()
    assert "the KV cache cannot hold one request under the server's policy (224 slots" in logged.err + logged.out


def _tiny_gpt_neox(folder):
    """A randomly initialised tiny ``GPTNeoXForCausalLM``: its attention has no ``o_proj`` (its
    output projection is ``dense``) and rotates a quarter of each head, so the model facts that
    CriticalKV and the RoPE policies read are missing on its workers."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    from kvpolicy.vllm.models import smollm2_folder

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=2048,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    GPTNeoXForCausalLM(config).float().save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_folder()).save_pretrained(folder)
    return folder


def test_a_request_needing_a_model_fact_the_workers_lack_fails_alone(tmp_path):
    """The front end sees the model's configuration, not its modules: a request whose policy
    reads a fact the loaded model cannot give (``criticalkv`` on GPT-NeoX: no ``o_proj``) passes
    it, and the engine core, which asked every worker at start-up, refuses it alone; the other
    requests are served and the server goes on."""
    llm = make_llm(_tiny_gpt_neox(tmp_path / "neox"), POLICY, block_size=BLOCK, max_num_seqs=4, processes=True)
    try:
        serve_beside_a_refused_request(llm, {"kvpolicy": "criticalkv"}, 80)
        out = llm.generate([tokens_prompt(list(range(10, 40)))], greedy(8), use_tqdm=False)  # still serving
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        close(llm)
