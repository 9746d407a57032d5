"""Throughput and memory of a vLLM server with and without kvpolicy eviction, at a fixed KV-cache size.

Each configuration starts its own engine (in turn), runs the same batch of long greedy
generations, and reports output tokens/s, wall time, the mean number of requests decoding per
engine step (counted from the engine's own per-step outputs, so for every configuration), and,
from kvpolicy's scheduler trace, the requests running, the peak KV blocks in use and the prefix
cache's hits. "full" is the same engine with a budget above every request's length: the plugin
is active but never evicts, which the tests show gives vLLM's own tokens. "vllm" is the engine
without kvpolicy at all, so "full" against "vllm" is the plugin's own overhead.

With ``--shared-prefix N`` every prompt starts with the same N tokens (a system prompt), and
``--prefix-caching`` turns vLLM's prefix cache on for every configuration::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --configs vllm,snapkv --shared-prefix 200 \
        --prefix-caching --requests 12 --new 384 --blocks 48

CPU (here; the bundled SmolLM2-135M, float32)::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --blocks 64 --requests 16 --new 512

The policies that read the model, uneven budgets and selection beside plain vLLM and SnapKV (a
policy this integration does not serve is recorded as refused, with its reason)::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --configs vllm,snapkv,criticalkv,triattention,pyramidkv,quest \
        --blocks 64 --requests 16 --new 512

A shared machine's load drifts between one engine's run and the next: ``--rounds N`` runs the
configurations N times, interleaved, and reports each one's median and its per-round ratio to
the first configuration::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --configs snapkv,pyramidkv --rounds 3 \
        --blocks 64 --requests 16 --new 512

Every built-in that evicts (``evicting``; any built-in may also be named, at budget 128) against
plain vLLM where the pool holds every request whole, so eviction buys no concurrency and only its
cost shows::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --configs vllm,full,evicting --blocks 320 \
        --requests 16 --new 384

``--async-scheduling both`` runs every configuration with vLLM's async scheduling off and on and
checks that every token is the same (vLLM's CPU platform switches async scheduling off; the
benchmark keeps it on with kvpolicy's test switch, ``KVPOLICY_VLLM_TEST_ASYNC_ON_CPU``)::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --configs vllm,full,snapkv --async-scheduling both \
        --requests 12 --new 384 --blocks 48

GPU (when one is lent; Qwen3-4B-shaped random weights built in code)::

    python benchmarks/vllm_bench.py --model qwen3-4b-random --requests 16 --new 8192 --blocks 4096 \
        --max-model-len 9216 --dtype bfloat16

The integration supports vLLM's CPU backend only so far: on a GPU kvpolicy refuses to start,
every kvpolicy configuration is recorded as refused, and "vllm" alone runs (see docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def triattention_file() -> dict:
    """TriAttention with its bundled calibration (SmolLM2-135M's, which serves the converted folder
    served here: the same model by its fingerprint), its recent buffer cut to 32 so that a 128
    budget leaves candidates; as a policy file, since a server names a policy or a file (mappings
    are per request)."""
    from importlib.resources import files

    import yaml

    spec = yaml.safe_load((files("kvpolicy") / "policies" / "triattention.yaml").read_text())
    spec["schedule"].update(budget=128, recent=32, interval=64)
    path = Path(tempfile.mkdtemp(prefix="kvbench-policy-")) / "triattention.yaml"
    path.write_text(yaml.safe_dump(spec))
    return {"policy": str(path)}


SELECT_BUDGET = 128  # select mode's attended slots (``--select-budget``)


def quest_pages_file() -> dict:
    """The shipped ``quest`` at page granularity over vLLM's blocks of 32, attending
    ``SELECT_BUDGET`` slots (a recent tail of 64), as a policy file (a server names a file)."""
    import yaml

    from kvpolicy import load_policy

    data = load_policy("quest", budget=SELECT_BUDGET, recent=64).config.to_dict()
    data = {**data, "name": "quest-pages", "scorer": {**data["scorer"], "page_size": 32, "granularity": "page"}}
    path = Path(tempfile.mkdtemp(prefix="kvbench-policy-")) / "quest-pages.yaml"
    path.write_text(yaml.safe_dump(data))
    return {"policy": str(path)}


POLICIES: dict[str, dict | Callable[[], dict] | None] = {
    "vllm": None,  # kvpolicy not switched on
    "full": {"policy": "none"},
    "snapkv": {"policy": "snapkv", "budget": 128},
    "streamingllm": {"policy": "streamingllm", "budget": 128},
    "rkv": {"policy": "rkv", "budget": 128},
    "vase-attnv": {"policy": "vase-attnv", "budget": 128},
    "h2o": {"policy": "h2o", "budget": 128},  # stages that keep state, carried per request
    "gkv": {"policy": "gkv", "budget": 128},
    # no score at all: the prompt kept, the rest random per head (Random Attention), and the ablation
    "random-prompt": {"policy": "random-prompt", "budget": 128},
    "random": {"policy": "random", "budget": 128},
    # policies that read the model (RoPE, each layer's o_proj)
    "criticalkv": {"policy": "criticalkv", "budget": 128},
    "expected-attention": {"policy": "expected-attention", "budget": 128},
    "triattention": triattention_file,
    # uneven budgets and selection: recorded as refused where this vLLM integration does not serve them
    "pyramidkv": {"policy": "pyramidkv", "budget": 128},
    "ada-vase-attnv": {"policy": "ada-vase-attnv", "budget": 128},
    "quest": {"policy": "quest", "budget": 128},
    # Quest at block pages (pages = vLLM's blocks of 32): attends only the chosen blocks and the tail
    "quest-pages": lambda: quest_pages_file(),
    # merges
    "cam": {"policy": "cam", "budget": 128},
    "d2o": {"policy": "d2o", "budget": 128},
}


def expand_configs(spec: str) -> list[str]:
    """``--configs`` as names: ``evicting`` stands for every built-in policy that evicts with one
    tier (what vLLM serves), and a built-in policy not in ``POLICIES`` runs at budget 128."""
    from kvpolicy import available_policies, load_policy

    built_in = available_policies()
    names: list[str] = []
    for c in spec.split(","):
        if c == "evicting":
            names += [n for n in built_in if (cfg := load_policy(n).config).mode == "evict" and cfg.recall is None]
        else:
            names.append(c)
    for n in names:
        if n not in POLICIES and n in built_in:
            POLICIES[n] = {"policy": n, "budget": 128}
    return list(dict.fromkeys(names))


def qwen3_4b_random(folder: Path) -> Path:
    """A Qwen3-4B-shaped config (weights drawn by vLLM: load_format='dummy')."""
    from transformers import Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True, dtype="bfloat16",
    ).save_pretrained(folder)
    from kvpolicy.vllm.models import smollm2_folder

    try:  # any tokenizer will do for random weights and token-id prompts
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(smollm2_folder()).save_pretrained(folder)
    except Exception:
        pass
    return folder


def layers_per_block(policy: dict | None, model: str) -> int:
    """How many of a per-layer server's blocks hold what one whole-model block holds: the model's
    layer count under a per-layer policy (``kvpolicy.vllm.budgets.per_layer``), else 1."""
    from kvpolicy.vllm.settings import NO_POLICY

    if policy is None or policy["policy"] == NO_POLICY:  # "full": the plugin on, no policy
        return 1
    from transformers import AutoConfig

    from kvpolicy import load_policy
    from kvpolicy.vllm.budgets import per_layer

    source = {k: v for k, v in policy.items() if k != "policy"}
    if not per_layer(load_policy(policy["policy"], **source)):
        return 1
    return int(AutoConfig.from_pretrained(model).num_hidden_layers)


def run_one(name: str, args: argparse.Namespace, model: str, extra: dict, async_on: bool = False) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    trace = Path(tempfile.mkdtemp(prefix=f"kvbench-{name}-"))
    policy = POLICIES[name]
    if callable(policy):
        policy = policy()
    if policy is not None:
        extra = {**extra, "additional_config": {"kvpolicy": {**policy, "trace": str(trace)}}}
    # A per-layer policy's server gives every layer a KV-cache group of its own, whose blocks hold
    # one layer each: the same bytes as ``--blocks`` whole-model blocks take that many times more.
    per_block = layers_per_block(policy, model)
    # vLLM's CPU platform switches async scheduling off in every process; kvpolicy's test switch
    # keeps it on (the plugin is loaded in every vLLM process, with or without a policy).
    switch = "KVPOLICY_VLLM_TEST_ASYNC_ON_CPU"
    if async_on:
        os.environ[switch] = "1"
    try:
        llm = LLM(
            model=model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
            block_size=args.block_size, num_gpu_blocks_override=args.blocks * per_block, max_num_seqs=args.requests,
            enable_prefix_caching=args.prefix_caching, async_scheduling=async_on, seed=0, **extra,
        )
    finally:
        os.environ.pop(switch, None)
    if llm.llm_engine.vllm_config.scheduler_config.async_scheduling is not async_on:
        raise RuntimeError(f"async scheduling is {not async_on}, asked {async_on}")
    rng = random.Random(0)
    prefix = [rng.randint(100, 3000) for _ in range(args.shared_prefix)]
    prompts = [TokensPrompt(prompt_token_ids=prefix + [rng.randint(100, 3000) for _ in range(args.prompt)])
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True, temperature=0.0)
    engine = llm.llm_engine
    t0 = time.time()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    tokens, decoding, finished = 0, [], 0
    token_ids: dict[str, list[int]] = {}
    # Decode throughput: from the step after which every request has its first token (every
    # prompt is in) to the end, the tokens generated in between.
    produced: dict[str, int] = {}
    decode_start: tuple[float, int] | None = None
    while finished < len(prompts):
        outs = engine.step()
        # requests that produced a token this step: what the engine actually ran at once
        decoding.append(sum(1 for o in outs if o.outputs and o.outputs[0].token_ids))
        for o in outs:
            if o.outputs:
                produced[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                finished += 1
                tokens += len(o.outputs[0].token_ids)
                token_ids[o.request_id] = list(o.outputs[0].token_ids)
        if decode_start is None and len(produced) == len(prompts) and min(produced.values()) > 0:
            decode_start = (time.time(), sum(produced.values()))
    wall = time.time() - t0
    decode_rate = None
    if decode_start is not None and time.time() > decode_start[0]:
        decode_rate = round((sum(produced.values()) - decode_start[1]) / (t0 + wall - decode_start[0]), 2)
    steps = []
    for path in trace.glob("scheduler-*.jsonl"):
        steps += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    shutil.rmtree(trace, ignore_errors=True)
    last = steps[-1] if steps else {}
    return {
        "config": name + (" (async)" if async_on else ""), "policy": policy, "async_scheduling": async_on,
        "engine_async": steps[-1].get("async") if steps else None,
        "requests": args.requests, "output_tokens": tokens, "token_ids": token_ids,
        "wall_s": round(wall, 2), "output_tok_per_s": round(tokens / wall, 2), "decode_tok_per_s": decode_rate,
        "mean_decoding": round(sum(decoding) / len(decoding), 2), "engine_steps": len(decoding),
        "peak_running": max((s["running"] for s in steps), default=None),
        "mean_running": round(sum(s["running"] for s in steps) / len(steps), 2) if steps else None,
        # in whole-model blocks (a per-layer group's block holds one layer)
        "peak_blocks_in_use": (max((s["held_blocks"] for s in steps), default=0) / per_block) if steps else None,
        "kv_blocks": args.blocks, "block_size": args.block_size,
        "evictions": sum(s["evicted"] for s in steps) if steps else None,
        "shared_prefix": args.shared_prefix, "prefix_caching": args.prefix_caching,
        "prefix_hit_rate": round(last["prefix_hit_total"] / last["prefix_queried_total"], 3)
        if last.get("prefix_queried_total") else None,
        "blocks_copied": last.get("blocks_copied_total"),
    }


def print_medians(results: list[dict], first: str) -> None:
    """Each configuration's median over its rounds, and the median of its ratios to the first
    configuration's run of the same round (``round`` of each result: each round ran every
    configuration once, one after the other; a round either one failed in gives no ratio)."""
    import statistics

    runs: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r:
            runs.setdefault(r["config"], []).append(r)
    print("\n| config | rounds | median output tok/s | median decode tok/s | output tok/s ratio to " + first + " |")
    print("| --- | --- | --- | --- | --- |")
    base = runs.get(first)
    for name, rs in runs.items():
        out = statistics.median(r["output_tok_per_s"] for r in rs)
        decode = [r["decode_tok_per_s"] for r in rs if r.get("decode_tok_per_s")]
        ratio = "-"
        if base is not None:
            base_of = {b["round"]: b for b in base}
            ratios = [r["output_tok_per_s"] / base_of[r["round"]]["output_tok_per_s"] for r in rs if r["round"] in base_of]
            if ratios:
                ratio = f"x{statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        print(f"| {name} | {len(rs)} | {out:.2f} | {statistics.median(decode) if decode else '-'} | {ratio} |")


def main() -> None:
    global SELECT_BUDGET
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (bundled), qwen3-4b-random, or a folder")
    parser.add_argument("--configs", default="vllm,full,snapkv,streamingllm,rkv")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (after the shared prefix)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                        help="vLLM's prefix cache on for every configuration")
    parser.add_argument("--new", type=int, default=512, help="generated tokens per request")
    parser.add_argument("--blocks", type=int, default=64, help="KV-cache blocks (fixed size for every config)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024, help="must fit in --blocks x --block-size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="off",
                        help="vLLM's async scheduling for every configuration (both: each runs twice)")
    parser.add_argument("--select-budget", type=int, default=SELECT_BUDGET,
                        help="slots select mode attends (quest, quest-pages)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations this many times, interleaved, and report each one's "
                             "median (a shared machine's load drifts between runs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    SELECT_BUDGET = args.select_budget
    POLICIES["quest"] = {"policy": "quest", "budget": SELECT_BUDGET}
    configs = expand_configs(args.configs)
    unknown = [c for c in configs if c not in POLICIES]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {sorted(POLICIES)}, any built-in policy, or 'evicting'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU: GiB reserved; --blocks sets what is used
    # The trace is read for the scheduler's per-step counts only: no worker saves its eviction
    # inputs (each a copy of every layer's slots and queries, written to disk: about 5 % of a
    # kvpolicy configuration's worker time at 16 requests, which plain vLLM never pays).
    os.environ.setdefault("KVPOLICY_VLLM_TRACE_SAVES", "0")
    extra: dict = {}
    if args.model == "smollm2":
        from kvpolicy.vllm.models import smollm2_folder

        model = str(smollm2_folder())
    elif args.model == "qwen3-4b-random":
        model = str(qwen3_4b_random(Path(tempfile.mkdtemp(prefix="qwen3-4b-"))))
        extra["load_format"] = "dummy"
    else:
        model = args.model
    results = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for round_, name in [(i, c) for i in range(args.rounds) for c in configs]:
        for async_on in modes:
            try:
                results.append(run_one(name, args, model, extra, async_on))
            except Exception as exc:  # a refusal (e.g. a GPU platform) is recorded, not fatal
                results.append({"config": name, "error": str(exc).splitlines()[0][:300]})
            results[-1]["round"] = round_
            print(json.dumps({k: v for k, v in results[-1].items() if k != "token_ids"}), flush=True)
    if len(modes) == 2:  # async scheduling must not change a single token
        by = {(r["config"].removesuffix(" (async)"), r.get("async_scheduling")): r for r in results if "error" not in r}
        for name in configs:
            a, b = by.get((name, False)), by.get((name, True))
            if a and b:
                print(f"{name}: tokens with async scheduling {'identical' if a['token_ids'] == b['token_ids'] else 'DIFFER'}; "
                      f"output tok/s async/sync x{b['output_tok_per_s'] / a['output_tok_per_s']:.2f}")
    print("\n| config | output tok/s | decode tok/s | wall s | engine steps | mean decoding | mean running | peak running "
          "| peak blocks in use | evictions | prefix hit rate | blocks copied |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | refused: {r['error']} |" + " |" * 11)
        else:
            cells = [r["output_tok_per_s"], r["decode_tok_per_s"], r["wall_s"], r["engine_steps"], r["mean_decoding"], r["mean_running"],
                     r["peak_running"],
                     f"{r['peak_blocks_in_use']} / {r['kv_blocks']}" if r["peak_blocks_in_use"] else None,
                     r["evictions"], r["prefix_hit_rate"], r["blocks_copied"]]
            print(f"| {r['config']} | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    if args.rounds > 1:
        print_medians(results, configs[0])
    base = next((r for r in results if r["config"].startswith("vllm") and "error" not in r), None)
    if base is not None and args.rounds == 1:
        for r in results:
            if r is not base and "error" not in r:
                decode = ""
                if r.get("decode_tok_per_s") and base.get("decode_tok_per_s"):
                    decode = f", decode tok/s x{r['decode_tok_per_s'] / base['decode_tok_per_s']:.2f}"
                print(f"{r['config']} / vllm: output tok/s x{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}"
                      f"{decode}, mean decoding x{r['mean_decoding'] / base['mean_decoding']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "token_ids"} for r in results],
                                             indent=2))


if __name__ == "__main__":
    main()
