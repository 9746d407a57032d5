"""Helpers shared by the vLLM test modules (not collected: no test_ prefix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 2048


#: Engine tests run with async scheduling on when KVPOLICY_TEST_ASYNC=1 (``make_llm``'s default).
ASYNC_DEFAULT = os.environ.get("KVPOLICY_TEST_ASYNC") == "1"


def make_llm(model: str | Path, kvpolicy: dict[str, Any] | None = None, *, async_scheduling: bool | None = None,
             processes: bool = False, **kwargs: Any):
    """An engine for the tests.

    ``processes=True`` starts vLLM's production layout: the engine core and the model runner in
    processes of their own, talking through vLLM's message queues (about 25 s more per engine on
    two cores: each process imports torch and vLLM). By default both run in the test's process
    (vLLM's in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and its one-process
    executor): the same scheduler, runner and kvpolicy hooks, without the processes. The modules
    that test what crosses a process boundary (the scheduler output a worker reads, each process
    loading the plugin) start theirs with ``processes=True``. An in-process engine sets up vLLM's
    process-wide parallel groups and closing it tears them down, so at most one runs at a time:
    an engine that outlives others started meanwhile (a module's shared engine) takes
    ``processes=True``, and a second in-process engine is refused while one runs.

    ``async_scheduling=True`` runs vLLM's async scheduling (the scheduler plans step N+1 before
    step N's output is back): vLLM's CPU platform switches it off ("not required on CPU") in the
    front end and again in the engine core, so kvpolicy's test switch
    (``KVPOLICY_VLLM_TEST_ASYNC_ON_CPU``, read by the plugin in every process) keeps it on."""
    import gc

    import vllm.envs
    from vllm import LLM

    from kvpolicy.vllm.hooks import TEST_ASYNC_ON_CPU

    args: dict[str, Any] = dict(
        model=str(model), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
        block_size=32, max_num_seqs=32, enable_prefix_caching=False, seed=0,
    )
    if not processes:
        if _IN_PROCESS:
            raise RuntimeError("an in-process engine is running: close it first, or start the engine that "
                               "outlives the other with processes=True (vLLM's parallel groups are process-wide)")
        args["distributed_executor_backend"] = "uni"
    args.update(kwargs)
    if kvpolicy is not None:
        args["additional_config"] = {"kvpolicy": kvpolicy}
    on = ASYNC_DEFAULT if async_scheduling is None else async_scheduling
    env = {TEST_ASYNC_ON_CPU: "1" if on else None, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if processes else "0"}
    saved = {name: os.environ.get(name) for name in env}
    _set_env(env)  # inherited by the engine processes started now
    try:
        llm = LLM(**args)
    finally:
        _set_env(saved)
        if not processes:
            # An engine core in this process caches vLLM's environment and freezes the heap for
            # its own lifetime: undone, so the next test's settings are read and this engine's
            # memory is collected once it is closed.
            vllm.envs.disable_envs_cache()
            gc.unfreeze()
    if not processes:
        _IN_PROCESS.add(id(llm))
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is on
    return llm


#: The in-process engine running now (``id`` of its ``LLM``), if any: ``close`` forgets it.
_IN_PROCESS: set[int] = set()


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def greedy(max_tokens: int, **kwargs: Any):
    from vllm import SamplingParams

    # min_tokens masks EOS until the end, as transformers' min_new_tokens does (ignore_eos alone would
    # let the model emit EOS and go on, where generate() picks the next-best token).
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kwargs)


def tokens_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


def read_jsonl(folder: Path, prefix: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(Path(folder).glob(f"{prefix}*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(output, i: int) -> float:
    """The gap between the two most likely tokens' log-probabilities at generated token ``i`` of a
    vLLM completion (``logprobs`` asked for); infinite when only one was returned."""
    ranked = sorted((x.logprob for x in output.outputs[0].logprobs[i].values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


#: One ``generate()`` reference row: the prompt's ids, the tokens, each token's top-2 logit gap.
Reference = tuple[list[int], list[int], list[float]]


def hf_model(model_dir: str | Path):
    """The transformers model of ``model_dir`` in float32, as the references decode it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_references(model, policy, prompts: list[list[int]], new: int) -> list[Reference]:
    """``generate()``'s greedy tokens for ``prompts`` with a fresh ``KVPolicyCache(policy, model)``
    (``policy`` None: the full cache), and each token's top-2 logit gap.

    The prompts decode as one left-padded batch: a row of it keeps what the row alone keeps
    (kvpolicy's padded-row promise, ``kvpolicy.hf.padded_rows``), and one decode step of the
    batch reads the model's weights once for every row, so a batch of three takes about 0.4x the
    time of its rows one by one on these CPUs (the references are most of the suite's set-ups).
    In float32 the batch's logits stayed within 6e-5 of the rows' alone (snapkv and h2o, three
    prompts, 256 tokens), a gap the tests' ``TIE`` already accepts between the engines, and every
    batch these tests decode (18 batches, 38 rows) gave each row's tokens alone (7 December 2026)."""
    import torch

    from kvpolicy import KVPolicyCache

    if not prompts:
        return []
    width = max(len(ids) for ids in prompts)
    pad = [width - len(ids) for ids in prompts]
    x = torch.tensor([[0] * p + list(ids) for p, ids in zip(pad, prompts, strict=True)])
    mask = torch.tensor([[0] * p + [1] * len(ids) for p, ids in zip(pad, prompts, strict=True)])
    cache = {} if policy is None else {"past_key_values": KVPolicyCache(policy, model)}
    with torch.no_grad():
        g = model.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0, **cache)
    top2 = torch.stack([lg.float().topk(2).values for lg in g.logits], dim=1)  # [R, new, 2]
    gaps = (top2[..., 0] - top2[..., 1]).tolist()
    return [(list(ids), g.sequences[r, width:].tolist(), gaps[r]) for r, ids in enumerate(prompts)]


def close(llm) -> None:
    """Stop an engine's processes now (the next engine then has the CPUs to itself)."""
    import gc

    _IN_PROCESS.discard(id(llm))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def generate_in_subprocess(
    folder: Path, model: str | Path, prompts: list[list[int]], max_tokens: int,
    kvpolicy: dict[str, Any] | None = None, env: dict[str, str | None] | None = None, **llm_kwargs: Any,
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from an engine started in a process of its own.

    For engines that need their own environment (``VLLM_PLUGINS``, thread binding): vLLM caches
    its environment, so setting it in the test process would stick to the engines started after.
    An ``env`` value None removes that variable.
    """
    out = folder / "tokens.json"
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from engine_util import make_llm, greedy, tokens_prompt\n"
        "if __name__ == '__main__':\n"
        f"    llm = make_llm({str(model)!r}, {kvpolicy!r}, **{llm_kwargs!r})\n"
        f"    outs = llm.generate([tokens_prompt(p) for p in {prompts!r}], greedy({max_tokens}), use_tqdm=False)\n"
        f"    open({str(out)!r}, 'w').write(json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n"
    )
    script = folder / "engine.py"
    script.write_text(code)
    log = folder / "engine.log"
    with open(log, "w") as f:
        merged = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        proc = subprocess.run([sys.executable, str(script)], env=merged,
                              timeout=1200, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"engine process failed ({proc.returncode}); its log ends:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def serve_beside_a_refused_request(llm, bad_extra: dict, new: int) -> dict:
    """Serve a plain request ("good") beside one whose kvpolicy settings the engine core refuses
    ("bad", ``bad_extra`` its ``extra_args``), ``new`` tokens each: checks the refused one failed
    alone (``finish_reason`` ``"error"``, no token) and the other got all its tokens; returns the
    finished outputs by name. ``llm`` runs vLLM's processes (``make_llm(..., processes=True)``):
    the engine-core process turns a refused request into its error output, where an in-process
    engine core raises the refusal to the caller."""
    if id(llm) in _IN_PROCESS:
        raise RuntimeError("a request refused alone needs an engine of vLLM's processes: make_llm(..., processes=True)")
    eng = llm.llm_engine
    eng.add_request("good", tokens_prompt(list(range(100, 140))), greedy(new))
    eng.add_request("bad", tokens_prompt(list(range(10, 40))), greedy(new, extra_args=bad_extra))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = out
    assert done["bad"].outputs[0].finish_reason == "error" and not done["bad"].outputs[0].token_ids
    assert len(done["good"].outputs[0].token_ids) == new
    return done
