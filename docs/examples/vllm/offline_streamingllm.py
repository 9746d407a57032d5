"""StreamingLLM inside vLLM on the bundled SmolLM2-135M: a generation four times longer than the budget.

Run with the vLLM venv (`make test-vllm` builds it): `.venv-vllm/bin/python docs/examples/vllm/offline_streamingllm.py`.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

from kvpolicy.vllm import additional_config  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder  # noqa: E402

if __name__ == "__main__":  # vLLM starts its workers with spawn
    trace = Path(tempfile.mkdtemp(prefix="kvpolicy-trace-"))  # optional: what the engine did
    llm = LLM(model=str(smollm2_folder()), dtype="float32", enforce_eager=True, max_model_len=2048,
              additional_config=additional_config("streamingllm", budget=128, trace=str(trace)))
    out = llm.generate(["List the numbers from one to two hundred: one, two, three,"],
                       SamplingParams(max_tokens=512, min_tokens=512, temperature=0))
    print(out[0].outputs[0].text[-300:])

    evictions = sum(1 for f in trace.glob("worker-*.jsonl") for _ in f.open())
    print(f"{len(out[0].outputs[0].token_ids)} tokens generated, {evictions} evictions, "
          "at most 128 + 64 slots held")
    assert evictions > 0
