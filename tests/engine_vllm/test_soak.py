"""A soak of the OpenAI server under kvpolicy (loopback only, bounded in count and time).

Two servers, each with a KV pool too small for the load (16 blocks of 32 of the whole model),
36 concurrent streamed completions mixing per-request policies and a shared prefix; 6 clients
drop their stream midway; malformed kvpolicy settings (sent plain, and one also streamed):

- **uniform**: prefix caching on, the server's policy ``triattention`` with a calibration
  measured here on the tiny model; per request among others the ones that read the model
  (``criticalkv``, ``expected-attention``), the merges ``cam`` and ``d2o``, per-head counts
  (``ada-vase-attnv``, ``dms``) and ``quest`` in select mode;
- **per-layer**: the server's policy ``cake`` (a KV-cache group per layer, each request's layer
  budgets decided from its own prompt), per request ``pyramidkv``, ``cake`` at another budget,
  per-head counts (``ada-snapkv``) and uniform ones (``snapkv``, ``criticalkv``, ``d2o``);
  preempted CAKE requests replay the budgets their first run decided.

Afterwards: every completed stream equals the same request sent alone to the idle server, the
malformed ones got HTTP 400 naming the problem, the KV pool is empty again (vLLM's usage metric
back to 0), and the server still answers.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files

import pytest
import yaml

pytest.importorskip("vllm")

from engine_util import ASYNC_DEFAULT  # noqa: E402
from test_serve import XARGS, _free_port, _post_status, _serve_command, _wait_healthy  # noqa: E402

from kvpolicy.vllm.hooks import TEST_ASYNC_ON_CPU  # noqa: E402
from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

pytestmark = pytest.mark.slow
N, DROPPED = 36, 6
MALFORMED = [  # (vllm_xargs, what the 400 must name)
    ({"kvpolicy": "no-such-policy"}, "unknown policy 'no-such-policy'"),
    ({"kvpolicy": "snapkv", "kvpolicy_budget": 0}, "does not load"),
    ({"kvpolicy": "h2o@select"}, "keep state"),
    ({"kvpolicy_budget": 64}, "given without 'kvpolicy'"),
]


def _calibration(model, out) -> str:
    """TriAttention's query calibration of the tiny model, measured on random token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvpolicy.calibrate import measure_query_calibration

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.randint(3, 4000, (384,), generator=torch.Generator().manual_seed(3))
    measure_query_calibration(hf, ids).save(out)
    return str(out)


#: Each per-request policy at a budget that evicts several times in a stream.
SMALL = {"budget": 48, "recent": 8, "interval": 16, "window": 8}
#: The per-request settings the soak mixes: the serve test's, then the policies that read the
#: model's facts, the merges, per-head counts (Ada-KV, DMS's threshold) and select mode. A request with none runs the server's policy, TriAttention with a
#: calibration of the tiny model (a file: only the server's own policy may name one).
SOAK_XARGS = [*XARGS, *({"kvpolicy": json.dumps({"policy": name, **SMALL})}
                        for name in ("snapkv", "criticalkv", "expected-attention", "cam", "d2o",
                                     "ada-vase-attnv", "dms")),
              {"kvpolicy": "quest", "kvpolicy_budget": 64}]  # select mode: every block held, 64 slots attended


#: The per-layer server's: a policy for every layer's group of its own (and malformed: select mode there).
LAYER_XARGS = [None, *({"kvpolicy": json.dumps({"policy": name, **SMALL})}
                       for name in ("pyramidkv", "snapkv", "criticalkv", "d2o", "ada-snapkv")),
               {"kvpolicy": json.dumps({"policy": "cake", **SMALL, "budget": 64})}]
LAYER_MALFORMED = [*MALFORMED, ({"kvpolicy": "quest"}, "KV-cache group per layer"),
                   ({"kvpolicy": "duo-attention"}, "is for a model with 30 layers")]  # its head profile: SmolLM2's


def _triattention_file(model, folder) -> str:
    spec = yaml.safe_load((files("kvpolicy") / "policies" / "triattention.yaml").read_text())
    spec["scorer"]["calibration"] = _calibration(model, folder / "tiny-qwen3.safetensors")
    spec["schedule"].update(SMALL)
    path = folder / "triattention-tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _workload(policies: list):
    rng = random.Random(5)
    prefix = [rng.randint(3, 4000) for _ in range(70)]
    out = []
    for i in range(N):
        own = [rng.randint(3, 4000) for _ in range(rng.randint(5, 40))]
        out.append(((prefix if i % 2 else []) + own, rng.randint(60, 160), policies[i % len(policies)]))
    return out


def _stream(port: int, body: dict, drop_after: int | None) -> tuple[int, list[int] | None, str]:
    """Stream one completion; returns (status, token ids or None if dropped, error text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, None, resp.read().decode()
        ids: list[int] = []
        chunks = 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            data = json.loads(line[6:])
            if "choices" not in data:  # an error reported inside the stream
                return 200, None, line
            ids.extend(data["choices"][0].get("token_ids") or [])
            if drop_after is not None and chunks >= drop_after:
                return 200, None, ""  # the client goes away mid-stream: vLLM aborts the request
        return 200, ids, ""
    finally:
        conn.close()


def _usage(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:kv_cache_usage_perc")]
    assert values, "no vllm:kv_cache_usage_perc metric"
    return max(values)


@pytest.mark.parametrize("server", ["uniform", "per-layer"])
def test_soak_of_the_openai_server(tmp_path, server):
    model = tiny_qwen3_folder()
    port = _free_port()
    log = tmp_path / "server.log"
    trace = str(tmp_path / "trace")
    if server == "uniform":
        config = json.dumps({"kvpolicy": {"policy": _triattention_file(model, tmp_path), "trace": trace}})
        xargs, malformed, flags = SOAK_XARGS, MALFORMED, ["--enable-prefix-caching", "--num-gpu-blocks-override", "16"]
    else:  # a block of a per-layer group holds one of the tiny model's 4 layers: 16 blocks of the whole model
        config = json.dumps({"kvpolicy": {"policy": "cake", **SMALL, "trace": trace}})
        xargs, malformed, flags = LAYER_XARGS, LAYER_MALFORMED, ["--no-enable-prefix-caching",
                                                                  "--num-gpu-blocks-override", "64"]
    reqs = _workload(xargs)
    body = {"model": str(model), "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

    def params(r):
        ids, n, xargs = r
        return {**body, "prompt": ids, "max_tokens": n, "min_tokens": n, **({"vllm_xargs": xargs} if xargs else {})}

    extra, env = [], dict(os.environ)
    if ASYNC_DEFAULT:  # the server with async scheduling on (kvpolicy's CPU test switch, in every process)
        extra, env[TEST_ASYNC_ON_CPU] = ["--async-scheduling"], "1"
    with open(log, "w") as f:
        proc = subprocess.Popen(_serve_command(model, port, "--additional-config", config, *flags,
                                               "--max-num-seqs", "32", *extra),
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, port, log)
        t0 = time.monotonic()
        drops = set(random.Random(6).sample(range(N), DROPPED))
        jobs = [lambda r=r, i=i: _stream(port, params(r), 3 if i in drops else None) for i, r in enumerate(reqs)]
        bad = [{**params((list(range(5, 30)), 20, None)), "vllm_xargs": x} for x, _ in malformed]
        # malformed ones plain (an HTTP 400), and the first once more as a stream (vLLM answers a
        # stream 200, then an error event with code 400)
        jobs += [lambda b=b: _post_status(port, b) for b in bad]
        jobs += [lambda: _stream(port, bad[0], None)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: job(), jobs))
        soak_s = time.monotonic() - t0
        for (status, answer), (_, message) in zip(results[N:N + len(malformed)], malformed, strict=True):
            assert status == 400 and message in answer["error"]["message"], (status, answer)
        status, ids, event = results[-1]
        assert status == 200 and ids is None and '"code": 400' in event and MALFORMED[0][1] in event
        completed = [i for i in range(N) if i not in drops]
        for i in completed:
            assert results[i][0] == 200 and results[i][1] is not None, (i, reqs[i][2], results[i][2][:500])
        # the pool drains (cached prefix blocks sit free in the queue: usage counts held blocks)
        deadline = time.monotonic() + 60
        while _usage(port) > 0 and time.monotonic() < deadline:
            time.sleep(1)
        assert _usage(port) == 0
        # each completed request alone on the now idle server: the same tokens
        for i in completed:
            status, alone = _post_status(port, params(reqs[i]))
            assert status == 200
            assert results[i][1] == alone["choices"][0]["token_ids"], f"request {i} ({reqs[i][2]})"
        print(f"soak ({server}): {N} streams ({DROPPED} dropped) and {len(malformed)} malformed in {soak_s:.1f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    steps = [json.loads(line) for p in (tmp_path / "trace").glob("scheduler-*.jsonl") for line in p.read_text().splitlines()]
    assert sum(s["evicted"] for s in steps) > 0 and steps[-1]["held_blocks"] == 0
    assert max(s["waiting"] for s in steps) > 0  # the pool could not take the load at once
    assert all(s["async"] is ASYNC_DEFAULT for s in steps)
    print(f"soak ({server}): {steps[-1]['preempted_total']} preemptions ({steps[-1]['preempted_after_evicting_total']} "
          f"after evicting), at most {max(s['waiting'] for s in steps)} waiting")
