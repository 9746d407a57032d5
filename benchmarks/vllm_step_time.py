"""Where a vLLM engine step's time goes under a kvpolicy policy: kvpolicy's hooks beside vLLM's own parts.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and
model runner in one process, so one set of timers sees them all) on the memory-bound workload of
``vllm_bench.py`` (16 requests of 32 random prompt tokens, greedy). Each method named below is
wrapped by a timer; the table gives its time per engine step and its calls per step. Rows nest
(``vllm.execute_model`` holds ``vllm._prepare_inputs``, which holds
``WorkerEviction.after_prepare_inputs``...): read a row against its parent, and two policies'
rows against each other (run them one after the other)::

    .venv-vllm/bin/python benchmarks/vllm_step_time.py snapkv --blocks 64
    .venv-vllm/bin/python benchmarks/vllm_step_time.py pyramidkv --blocks 64

A line above the table says what the steps carried: tokens through the model (a request
preempted for lack of blocks is recomputed, prompt and tokens so far), vLLM's preemptions,
requests running per step and the share of the pool in use; two policies' steps compare only
where those are alike.

``--blocks`` counts whole-model blocks, as ``vllm_bench.py``'s does (a per-layer policy's pool
gets one block per layer for each: the same bytes).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import time
from typing import Any

from vllm_bench import layers_per_block

#: kvpolicy's per-step work, by class (``kvpolicy.vllm``)
KVPOLICY = {
    "worker.WorkerEviction": ["after_prepare_inputs", "after_execute", "capture_queries", "after_attention",
                              "attend_heads", "attend_selected", "group_metadata"],
    "paged_cache.PagedCache": ["begin_step", "advance_step", "evict_due"],
    "scheduler.SchedulerEviction": ["counted_slots", "copy_blocks", "replay_cap", "after_schedule", "after_update"],
    "select.BlockSelection": ["begin_step", "attend", "_choose", "_summarise", "_short_page_keys", "_window"],
}
#: vLLM's own parts of a step: the scheduler's, then the model runner's
VLLM_SCHEDULER = ["schedule", "update_from_output"]
VLLM_RUNNER = ["execute_model", "_update_states", "_prepare_inputs", "_build_attention_metadata", "_model_forward",
               "sample_tokens"]


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time ``owner.name`` (a class's method, or a module's function its callers look up at each call)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class Load:
    """What the steps carried: tokens through the model (recomputes after preemption included),
    vLLM's preemptions (and the tokens each victim had computed: its recompute), requests
    running and KV blocks in use, summed over the timed steps."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.tokens = self.running = self.blocks_used = self.steps = self.pool = 0
        self.victims: list[int] = []  # tokens each preempted request had computed

    def watch(self, scheduler_cls: Any) -> None:
        load = self
        schedule, preempt = scheduler_cls.schedule, scheduler_cls._preempt_request

        @functools.wraps(schedule)
        def counted_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = schedule(self, *args, **kwargs)
            pool = self.kv_cache_manager.block_pool
            load.steps += 1
            load.tokens += out.total_num_scheduled_tokens
            load.running += len(self.running)
            load.pool = pool.num_gpu_blocks
            load.blocks_used += pool.num_gpu_blocks - pool.get_num_free_blocks()
            return out

        @functools.wraps(preempt)
        def counted_preempt(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            load.victims.append(int(request.num_computed_tokens))
            return preempt(self, request, *args, **kwargs)

        scheduler_cls.schedule, scheduler_cls._preempt_request = counted_schedule, counted_preempt

    def summary(self) -> str:
        steps = self.steps or 1
        victims = sorted(self.victims)
        median = f" (their computed tokens: median {victims[len(victims) // 2]}, most {victims[-1]})" if victims else ""
        return (f"{self.tokens} tokens through the model ({self.tokens / steps:.1f} per step, recomputes included), "
                f"{len(victims)} preemptions{median}, {self.running / steps:.2f} requests running per step, "
                f"{100 * self.blocks_used / steps / max(self.pool, 1):.0f} % of the {self.pool} blocks in use")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policy", help="a built-in policy (budget --budget), or 'vllm' for no kvpolicy")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=64, help="whole-model KV-cache blocks of 32 slots")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--decode-only", action="store_true",
                        help="time from the step after every prompt is in (as vllm_bench's decode tok/s)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpolicy.vllm.models import smollm2_folder

    timers = Timers()
    for path, names in KVPOLICY.items():
        module, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(f"kvpolicy.vllm.{module}"), cls_name)
        for name in names:
            timers.wrap(cls, name, f"{cls_name}.{name}")
    model = str(smollm2_folder())
    policy = None if args.policy == "vllm" else {"policy": args.policy, "budget": args.budget}
    if args.prompt + args.new > args.max_model_len:
        parser.error(f"--prompt {args.prompt} plus --new {args.new} is past --max-model-len {args.max_model_len}")
    extra = {} if policy is None else {"additional_config": {"kvpolicy": policy}}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len, block_size=32,
              num_gpu_blocks_override=args.blocks * layers_per_block(policy, model), max_num_seqs=args.requests,
              enable_prefix_caching=False, seed=0, **extra)
    core = llm.llm_engine.engine_core.engine_core  # in-process: the engine core itself
    load = Load()  # wrapped first: the timers' schedule then times it with the count inside
    load.watch(type(core.scheduler))
    for name in VLLM_SCHEDULER:
        timers.wrap(type(core.scheduler), name, f"vllm.{name}")
    runner = core.model_executor.driver_worker.worker.model_runner
    missing = [name for name in VLLM_RUNNER if not hasattr(type(runner), name)]
    if missing:  # another vLLM release: say which rows the table lacks, rather than drop them unseen
        print(f"warning: this vLLM's model runner has no {missing}: those rows are missing")
    for name in VLLM_RUNNER:
        if name not in missing:
            timers.wrap(type(runner), name, f"vllm.{name}")
    # the attention layers' forward (kvpolicy's hook around vLLM's backend) and, on CPU, vLLM's kernel
    layer = next(iter(runner.compilation_config.static_forward_context.values()))
    timers.wrap(type(layer.impl), "forward", "attention forward (kvpolicy's hook, vLLM's backend)")
    from vllm import _custom_ops

    if hasattr(_custom_ops, "cpu_attention_with_kv_cache"):
        timers.wrap(_custom_ops, "cpu_attention_with_kv_cache", "vllm's CPU attention kernel")
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randint(100, 3000) for _ in range(args.prompt)])
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True, temperature=0.0)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    timers.clear()
    load.clear()
    start = time.perf_counter()
    decoding: set[str] = set()  # requests past their prompt: with --decode-only, timing starts once every one is
    waiting = args.decode_only
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                decoding.add(out.request_id)
        if waiting and len(decoding) == len(prompts):
            timers.clear()
            load.clear()
            waiting, start = False, time.perf_counter()
    wall = time.perf_counter() - start
    steps = timers.calls["vllm.schedule"] or 1
    what = "decode steps" if args.decode_only else "engine steps"
    print(f"{args.policy}: {steps} {what}, {1000 * wall / steps:.2f} ms per step ({wall:.1f} s)")
    print(f"{load.summary()}\n")
    print("| part | ms per step | calls per step |")
    print("| --- | --- | --- |")
    for label, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {1000 * seconds / steps:.3f} | {timers.calls[label] / steps:.1f} |")


if __name__ == "__main__":
    main()
