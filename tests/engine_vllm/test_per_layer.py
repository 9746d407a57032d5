"""Per-layer budgets served by vLLM: PyramidKV's layers keep budgets of their own, each layer in a
KV-cache group of its own (``kvpolicy.vllm.layer_spec``: one block table per layer, blocks from
the one shared pool), so the blocks a request holds follow its layers' budgets.

The bundled SmolLM2-135M (30 layers) under the server's ``pyramidkv`` at a mean budget of 96
(layer budgets 172 down to 20) over a prompt plus 224 new tokens, so every layer evicts several
times, beside a ``snapkv`` request (a uniform policy per request, on the same groups): the tokens
equal the transformers path's (``KVPolicyCache`` + ``generate()``) but where both engines' top-2
logits are within a rounding tie; the scheduler's trace (vLLM's block managers, one per group)
shows each layer's group holding its own budget's blocks, and each request's bytes: a block of a
per-layer group holds one layer's keys and values of ``BLOCK`` tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import close, first_divergence, greedy, make_llm, read_jsonl, tokens_prompt, top2_gap  # noqa: E402

from kvpolicy import load_policy  # noqa: E402

BUDGET = 96
NEW = 224
BLOCK = 32  # the CPU backend's blocks are multiples of 32
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
OVERRIDES = {"budget": BUDGET, "recent": 16, "interval": 16, "window": 16}
PYRAMID = ["Write a long story about a dragon who learns to code. Once upon a time"]
UNIFORM = "Explain in detail how a steam engine works, step by step."


@pytest.fixture(scope="module")
def model_dir():
    from kvpolicy.vllm.models import smollm2_folder

    return smollm2_folder()


#: Rows of ``hf_refs`` already computed in this session, by (model folder, policy name, prompt): the
#: tests share some (every one serves ``snapkv`` on ``UNIFORM``; CAKE's serves under sync and async
#: scheduling), and a row depends on nothing else (a fresh model, the module's settings).
_ROWS: dict[tuple[str, str, str], tuple] = {}
_CONFIGS: dict[str, object] = {}


def hf_refs(model_dir, jobs):
    """``KVPolicyCache`` + ``generate()`` for (policy name, prompt) pairs (before the engine starts:
    CPUs are few): prompt ids, tokens, and each step's top-2 logit gap. Each pair is computed once
    per session (``_ROWS``)."""
    missing = [(name, text) for name, text in jobs if (str(model_dir), name, text) not in _ROWS]
    if missing or str(model_dir) not in _CONFIGS:
        rows, config = _hf_refs(model_dir, missing)
        _ROWS.update({(str(model_dir), name, text): row for (name, text), row in zip(missing, rows, strict=True)})
        _CONFIGS[str(model_dir)] = config
    return [_ROWS[str(model_dir), name, text] for name, text in jobs], _CONFIGS[str(model_dir)]


def _hf_refs(model_dir, jobs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    rows = [engine_util.hf_references(model, load_policy(name, **OVERRIDES), [tokenizer(text).input_ids], NEW)[0]
            for name, text in jobs]
    config = model.config
    del model
    return rows, config


def agreed_with_generate(refs, outs) -> list[int]:
    """How many tokens of each request equal ``generate()``'s before they first differ, failing
    on a difference that is not a rounding tie of the top-2 logits in either engine."""
    agreed = []
    for (ids, ref, margins), out in zip(refs, outs, strict=True):
        i = first_divergence(list(out.outputs[0].token_ids), ref)
        agreed.append(NEW if i is None else i)
        if i is not None:
            gap = top2_gap(out, i)
            assert margins[i] < TIE or gap < TIE, (
                f"prompt {ids[:8]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), {gap:.2e} (vllm)")
    return agreed


def layer_block_bytes(config) -> int:
    """The bytes of one block of a per-layer group: one layer's float32 keys and values of ``BLOCK`` tokens."""
    head_dim = int(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads))
    return 2 * BLOCK * int(config.num_key_value_heads) * head_dim * 4


def serve_beside_snapkv(model_dir, policy: str, refs, tmp_path, **llm_kwargs):
    """The two prompts of ``refs`` served at once: the first under the server's ``policy``, the
    second under ``snapkv`` per request, with the engine's trace in ``tmp_path``."""
    llm = make_llm(model_dir, {"policy": policy, **OVERRIDES, "trace": str(tmp_path)}, block_size=BLOCK, **llm_kwargs)
    try:
        params = [greedy(NEW, logprobs=2),
                  greedy(NEW, logprobs=2, extra_args={"kvpolicy": {"policy": "snapkv", **OVERRIDES}})]
        return llm.generate([tokens_prompt(ids) for ids, _, _ in refs], params, use_tqdm=False)
    finally:
        close(llm)


def test_pyramidkv_gives_generates_tokens_and_holds_its_layers_blocks(model_dir, tmp_path):
    import time

    from vllm.exceptions import VLLMValidationError

    jobs = [("pyramidkv", t) for t in PYRAMID] + [("snapkv", UNIFORM)]
    refs, config = hf_refs(model_dir, jobs)
    layers = int(config.num_hidden_layers)
    budgets = [s.budget for s in load_policy("pyramidkv", **OVERRIDES).layer_schedules(layers, config.num_key_value_heads)]
    assert max(budgets) + OVERRIDES["interval"] < min(len(ids) for ids, _, _ in refs) + NEW  # every layer evicts
    start = time.monotonic()
    llm = make_llm(model_dir, {"policy": "pyramidkv", **OVERRIDES, "trace": str(tmp_path)}, block_size=BLOCK)
    try:
        params = [greedy(NEW, logprobs=2)] * len(PYRAMID) + [
            greedy(NEW, logprobs=2, extra_args={"kvpolicy": {"policy": "snapkv", **OVERRIDES}})]
        outs = llm.generate([tokens_prompt(ids) for ids, _, _ in refs], params, use_tqdm=False)
        # Select mode keeps every block and attends a choice: not implemented on per-layer groups.
        with pytest.raises(VLLMValidationError, match="policy 'quest'.*KV-cache group per layer"):
            llm.generate([tokens_prompt(refs[0][0])], greedy(4, extra_args={"kvpolicy": "quest"}), use_tqdm=False)
    finally:
        close(llm)
    wall = time.monotonic() - start
    agreed = agreed_with_generate(refs, outs)

    # Every layer's group evicted, to its own budget (the pyramid's), several times per request.
    evictions: dict[tuple[str, int], int] = {}
    kept: dict[int, set[int]] = {}
    names: dict[str, str] = {}  # the engine's request id -> its policy
    for rec in read_jsonl(tmp_path, "worker-"):
        (layer,) = rec["layers"]
        for req in rec["requests"]:
            evictions[req, layer] = evictions.get((req, layer), 0) + 1
            names[req] = rec["policy"]
        kept.setdefault(layer, set()).add(rec["kept"])
    requests = {req for req, _ in evictions}
    assert len(requests) == len(refs) and sorted(names.values()) == sorted(name for name, _ in jobs), names
    assert min(evictions.get((req, layer), 0) for req in requests for layer in range(layers)) >= 3, evictions
    for layer, counts in kept.items():  # pyramidkv's layer budget, or snapkv's uniform one
        assert counts == {budgets[layer], BUDGET}, (layer, counts)

    # Blocks from vLLM's pool, per group: what its requests hold, in use in the pool; group 0
    # (the largest budget) holds more blocks than the last (the smallest) once they evicted.
    steps = read_jsonl(tmp_path, "scheduler-")
    assert all(s["total_blocks"] - s["free_blocks"] == s["held_blocks"] == sum(s["group_blocks"]) for s in steps)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    peak_room = [cdiv(b + OVERRIDES["interval"], BLOCK) for b in budgets]  # a pyramid request's most per layer
    uniform_room = cdiv(BUDGET + OVERRIDES["interval"], BLOCK)
    for s in steps:
        for g, blocks in enumerate(s["group_blocks"]):
            assert blocks <= len(PYRAMID) * peak_room[g] + uniform_room, (s["step"], g, blocks)
    assert steps[-1]["group_blocks"][0] == 0 and steps[-1]["held_blocks"] == 0  # all back in the pool at the end

    # Bytes: a block of a per-layer group holds one layer of BLOCK tokens (keys and values, float32).
    block_bytes = layer_block_bytes(config)
    (pyramid_req,) = [r for r, n in names.items() if n == "pyramidkv"]
    (uniform_req,) = [r for r, n in names.items() if n == "snapkv"]
    both = [s["request_blocks"] for s in steps if pyramid_req in s["request_blocks"] and uniform_req in s["request_blocks"]]
    pyramid_peak = max(b[pyramid_req] for b in both)
    uniform_peak = max(b[uniform_req] for b in both)
    mean = sum(b[pyramid_req] for b in both) / sum(b[uniform_req] for b in both)
    ratio = pyramid_peak / uniform_peak
    print(f"pyramidkv@{BUDGET} (layer budgets {budgets[0]}..{budgets[-1]}): a request holds at most {pyramid_peak} "
          f"layer-blocks of {block_bytes / 1024:.0f} KiB ({pyramid_peak * block_bytes / 2**20:.2f} MiB) against "
          f"snapkv@{BUDGET}'s {uniform_peak} ({uniform_peak * block_bytes / 2**20:.2f} MiB): x{ratio:.3f} at the peak, "
          f"x{mean:.3f} summed over the {len(both)} steps both ran; a one-group server holds {layers} x "
          f"{uniform_room} = {layers * uniform_room} for either; evictions per request and layer "
          f"{min(evictions.values())}-{max(evictions.values())}; tokens equal to generate()'s before any "
          f"divergence: {agreed} of {NEW}; engine {wall:.0f} s")
    assert uniform_peak == layers * uniform_room  # a uniform request: every layer its budget's blocks
    assert ratio <= 1.05


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cake_gives_generates_tokens_and_frees_each_layers_blocks_past_its_budget(model_dir, tmp_path,
                                                                                 async_scheduling):
    """CAKE's layer budgets, decided by the workers from each request's own prompt at its first
    eviction, then learned by the scheduler (with that step's output; with async scheduling
    after the next step was scheduled): the tokens equal ``generate()``'s, every layer evicts to
    its own budget, and a request's blocks follow those budgets, read from vLLM's pool."""
    jobs = [("cake", PYRAMID[0]), ("snapkv", UNIFORM)]
    refs, config = hf_refs(model_dir, jobs)
    layers = int(config.num_hidden_layers)
    agreed = agreed_with_generate(refs, serve_beside_snapkv(model_dir, "cake", refs, tmp_path,
                                                            async_scheduling=async_scheduling))

    # The workers' evictions: the CAKE request's layers keep uneven budgets adding up to the total.
    names: dict[str, str] = {}
    budgets: dict[str, dict[int, set[int]]] = {}
    evictions: dict[tuple[str, int], int] = {}
    for rec in read_jsonl(tmp_path, "worker-"):
        (layer,) = rec["layers"]
        for req in rec["requests"]:
            names[req] = rec["policy"]
            budgets.setdefault(req, {}).setdefault(layer, set()).add(rec["budget"])
            evictions[req, layer] = evictions.get((req, layer), 0) + 1
    (cake_req,) = [r for r, n in names.items() if n == "cake"]
    (uniform_req,) = [r for r, n in names.items() if n == "snapkv"]
    assert all(len(b) == 1 for b in budgets[cake_req].values())  # decided once
    decided = [next(iter(budgets[cake_req][layer])) for layer in range(layers)]
    assert len(set(decided)) > 1 and sum(decided) == layers * BUDGET, decided
    per_layer = [evictions[cake_req, layer] for layer in range(layers)]
    assert min(per_layer) >= 3, evictions

    # Blocks from vLLM's pool: after its first eviction each layer's group holds its budget's blocks.
    steps = read_jsonl(tmp_path, "scheduler-")
    assert all(s["total_blocks"] - s["free_blocks"] == s["held_blocks"] == sum(s["group_blocks"]) for s in steps)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    room = sum(cdiv(b + OVERRIDES["interval"], BLOCK) for b in decided)  # a request's most once decided
    both = [s["request_blocks"] for s in steps if cake_req in s["request_blocks"] and uniform_req in s["request_blocks"]]
    cake_peak, uniform_peak = max(b[cake_req] for b in both), max(b[uniform_req] for b in both)
    late = [b[cake_req] for b in both[len(both) // 2:]]  # long after the first eviction
    assert max(late) <= room, (max(late), room)
    mean = sum(b[cake_req] for b in both) / sum(b[uniform_req] for b in both)
    block_bytes = layer_block_bytes(config)
    print(f"cake@{BUDGET} ({'async' if async_scheduling else 'sync'} scheduling; layer budgets decided "
          f"{min(decided)}..{max(decided)}): a request holds at most {cake_peak} layer-blocks "
          f"({cake_peak * block_bytes / 2**20:.2f} MiB) against snapkv@{BUDGET}'s {uniform_peak}: "
          f"x{cake_peak / uniform_peak:.3f} at the peak, x{mean:.3f} summed over the {len(both)} steps both ran, "
          f"at most {room} once decided; evictions per layer {min(per_layer)}-{max(per_layer)}; tokens equal to generate()'s before any "
          f"divergence: {agreed} of {NEW}")
    assert cake_peak / uniform_peak <= 1.05


def test_duo_attention_gives_generates_tokens_and_holds_its_layers_largest_head_share(model_dir, tmp_path):
    """DuoAttention (the bundled passkey head profile of this model: half its heads stream) on a
    group per layer: retrieval and streaming heads keep counts of their own, and its layers
    budgets of their own. The tokens equal ``generate()``'s; at its last eviction every layer's
    heads keep exactly their shares (a streaming head its sinks and recent slots); each layer's
    group holds the room for its largest share (``DuoAllocation.layer_head_cap``), read from
    vLLM's pool: heads sharing a block free no memory per head, so the bytes are reported against
    a uniform request's at the same total budget."""
    jobs = [("duo-attention", PYRAMID[0]), ("snapkv", UNIFORM)]
    refs, config = hf_refs(model_dir, jobs)
    layers, hkv = int(config.num_hidden_layers), int(config.num_key_value_heads)
    policy = load_policy("duo-attention", **OVERRIDES)
    schedules = policy.layer_schedules(layers, hkv)
    shares = [policy.config.allocation.head_budgets(layer, s.budget, OVERRIDES["recent"]) for layer, s in enumerate(schedules)]
    agreed = agreed_with_generate(refs, serve_beside_snapkv(model_dir, "duo-attention", refs, tmp_path))

    names: dict[str, str] = {}
    evictions: dict[tuple[str, int], int] = {}
    last: dict[int, list[int]] = {}  # the DuoAttention request's head counts at each layer's last eviction
    for rec in read_jsonl(tmp_path, "worker-"):
        (layer,) = rec["layers"]
        for j, req in enumerate(rec["requests"]):
            names[req] = rec["policy"]
            evictions[req, layer] = evictions.get((req, layer), 0) + 1
            if rec["head_counts"] is not None:
                last[layer] = rec["head_counts"][j][0]
    (duo_req,) = [r for r, n in names.items() if n == "duo-attention"]
    (uniform_req,) = [r for r, n in names.items() if n == "snapkv"]
    per_layer = [evictions[duo_req, layer] for layer in range(layers)]
    assert min(per_layer) >= 3, evictions
    assert [last[layer] for layer in range(layers)] == shares

    steps = read_jsonl(tmp_path, "scheduler-")
    assert all(s["total_blocks"] - s["free_blocks"] == s["held_blocks"] == sum(s["group_blocks"]) for s in steps)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    room = sum(cdiv(max(row) + OVERRIDES["interval"], BLOCK) for row in shares)  # its most: each layer's largest share
    both = [s["request_blocks"] for s in steps if duo_req in s["request_blocks"] and uniform_req in s["request_blocks"]]
    duo_peak, uniform_peak = max(b[duo_req] for b in both), max(b[uniform_req] for b in both)
    assert duo_peak <= room and uniform_peak == layers * cdiv(BUDGET + OVERRIDES["interval"], BLOCK)
    assert steps[-1]["held_blocks"] == 0
    mean = sum(b[duo_req] for b in both) / sum(b[uniform_req] for b in both)
    block_bytes = layer_block_bytes(config)
    used = sum(sum(row) for row in shares)
    print(f"duo-attention@{BUDGET} (layer budgets {min(s.budget for s in schedules)}..{max(s.budget for s in schedules)}, "
          f"largest head shares {min(max(r) for r in shares)}..{max(max(r) for r in shares)}): a request holds at most "
          f"{duo_peak} layer-blocks ({duo_peak * block_bytes / 2**20:.2f} MiB) against snapkv@{BUDGET}'s {uniform_peak} "
          f"({uniform_peak * block_bytes / 2**20:.2f} MiB): x{duo_peak / uniform_peak:.3f} at the peak, x{mean:.3f} summed "
          f"over the {len(both)} steps both ran (its heads use {used} slot-heads after an eviction, as a uniform "
          f"request's do); evictions per layer {min(per_layer)}-{max(per_layer)}; tokens equal to "
          f"generate()'s before any divergence: {agreed} of {NEW}")
