"""The engine tests' ``generate()`` references, each batch against its rows decoded alone.

The vLLM engine tests (``tests/engine_vllm``) compare vLLM's tokens with ``KVPolicyCache`` +
``generate()``, whose references decode each policy's prompts as one left-padded batch
(``engine_util.hf_references``). A padded row keeps what the row alone keeps (kvpolicy's
padded-row promise), but the model's batched products may round otherwise: this decodes every
batch those tests decode and each of its rows alone, on one thread as the tests do, and says for
each row whether the tokens are the same (else the first difference and both top-2 gaps there)
and how long each took. Runs in the vLLM venv (the test modules import vLLM)::

    .venv-vllm/bin/python benchmarks/engine_references.py [NAME_PREFIX ...]

e.g. ``select/`` or ``chunked/pyramidkv`` for some of them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "tests" / "engine_vllm"


def batches(tokenizer: Any) -> list[tuple[str, Any, list[list[int]], int]]:
    """(name, policy, prompts, new tokens) of every batch the engine tests decode."""
    import test_model_facts
    import test_per_head
    import test_select
    import test_smollm2
    import test_stateful

    from kvpolicy import load_policy

    def ids(texts: list[str]) -> list[list[int]]:
        return [tokenizer(t).input_ids for t in texts]

    long = json.loads((ENGINE_TESTS.parent / "fixtures" / "long_prompts.json").read_text())["prompts"]
    out: list[tuple[str, Any, list[list[int]], int]] = []
    for name in test_smollm2.REFERENCE_POLICIES:
        out.append((f"smollm2/{name}", load_policy(name, budget=test_smollm2.BUDGET), ids(test_smollm2.PROMPTS),
                    test_smollm2.NEW))
    for name, source in test_select.POLICIES.items():
        out.append((f"select/{name}", None if source is None else load_policy(source), ids(test_select.PROMPTS),
                    test_select.NEW))
    out.append(("select/quest-pages@long", load_policy(test_select.POLICIES["quest-pages"]), long,
                test_select.LONG_NEW))
    for name in test_per_head.POLICY_NAMES:
        out.append((f"per_head/{name}", load_policy(name, **test_per_head.OVERRIDES), ids(test_per_head.PROMPTS),
                    test_per_head.NEW))
    for name, (source, overrides) in test_model_facts.POLICIES.items():
        out.append((f"model_facts/{name}", load_policy(source, **overrides), ids(test_model_facts.PROMPTS),
                    test_model_facts.NEW))
    for name, policy in test_stateful.reference_policies().items():
        out.append((f"stateful/{name}", policy, ids(test_stateful.PROMPTS), test_stateful.NEW))
    import test_chunked_prefill

    for name, source in test_chunked_prefill.POLICIES.items():
        settings = {k: v for k, v in source.items() if k != "policy"}
        out.append((f"chunked/{name}", load_policy(source["policy"], **settings), long, test_chunked_prefill.NEW))
    return out


def main(prefixes: list[str]) -> int:
    import torch

    torch.set_num_threads(1)  # as each pytest-xdist worker of the engine tests runs
    sys.path.insert(0, str(ENGINE_TESTS))
    from engine_util import first_divergence, hf_model, hf_references
    from transformers import AutoTokenizer

    from kvpolicy.vllm.models import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = hf_model(folder)
    differ = 0
    for name, policy, prompts, new in batches(tokenizer):
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        start = time.perf_counter()
        batch = hf_references(model, policy, prompts, new)
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        alone = [hf_references(model, policy, [ids], new)[0] for ids in prompts]
        alone_s = time.perf_counter() - start
        rows = []
        for (_, tokens, gaps), (_, tokens_alone, gaps_alone) in zip(batch, alone, strict=True):
            i = first_divergence(tokens, tokens_alone)
            differ += i is not None
            rows.append("same" if i is None else
                        f"differ at {i} (top-2 gaps {gaps[i]:.1e} batch, {gaps_alone[i]:.1e} alone)")
        print(f"{name}: batch {batch_s:.0f} s, alone {alone_s:.0f} s: {'; '.join(rows)}", flush=True)
    print(f"rows whose batch tokens differ from their tokens alone: {differ}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
