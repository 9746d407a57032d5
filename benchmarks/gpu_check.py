"""The GPU check in one command: exactness on the device, decode speed and memory, and the
long-context selection table, written to one JSON file and one markdown table.

Needs only torch and transformers (and kvpolicy's pure-Python dependencies: ``make gpu-check``
installs them from the wheels ``make gpu-wheels`` downloaded, without network). No model
weights: every model is randomly initialised from a config built in code. Three parts, each
written to the outputs as soon as it is done (a part that fails is recorded, not fatal):

1. **exactness** (a tiny random Qwen3, float32 and bfloat16): ``generate()`` with
   ``KVPolicyCache`` gives the tokens ``DynamicCache`` gives when the budget exceeds the length
   (``snapkv``, ``vase-attnv``, ``quest``, ``oracle-topk``); each row of a left-padded batch
   decodes the tokens it decodes alone under eviction and selection (``snapkv``,
   ``vase-attnv``, ``ada-snapkv`` (per-head budgets), ``quest``, at a budget below the length),
   end to end where the full cache is batch-invariant on the device and dtype, else kvpolicy's
   part on replayed inputs (``kvpolicy.hf.padded_rows``; each row says which and why);
2. **speed**: a Qwen3-4B-shaped random model, bfloat16, batch 16, a 16K-token context
   prefilled, then decode steps timed, for the full cache, eviction policies (the prompt
   compressed once it is in, so every timed step reads ``budget`` to ``budget + interval``
   slots) and selection policies, at budget 2048: tokens/s, peak memory (prefill included,
   and decode alone) and the KV bytes held;
3. **long context**: ``long_decode_bench.py``'s table (2K, 8K, 32K tokens; full cache,
   eviction floor, ``quest``, ``oracle-topk``, ``vase-attnv@select``) on the device.

Usage::

    make gpu-check                                   # on the GPU machine (docs/benchmarks.md)
    python benchmarks/gpu_check.py --device cpu --small --out runs/gpu-check-cpu   # CI: ~1 min

The process exits with status 1 when an exactness check fails (after writing the outputs).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; say so to transformers too
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks

import torch  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")

import gpu_decode_bench  # noqa: E402
import long_decode_bench  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.eval.config import EvalError  # noqa: E402
from kvpolicy.eval.cost import cache_bytes  # noqa: E402
from kvpolicy.eval.models import resolve_device  # noqa: E402
from kvpolicy.files import check_output, replace_file  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402
from kvpolicy.hf.padded_rows import check_padded_rows  # noqa: E402

EXACT_POLICIES = ("snapkv", "vase-attnv", "quest", "oracle-topk")
ALONE_POLICIES = ("snapkv", "vase-attnv", "ada-snapkv", "quest")  # ada-snapkv: uneven heads
SPEED_CACHES = (
    "full", "streamingllm", "snapkv", "rkv", "vase-attnv", "vase-dkv", "quest", "oracle-topk", "vase-attnv@select",
)


@dataclass(frozen=True)
class Sizes:
    """What each part runs at: the GPU defaults, or ``--small`` (CPU, CI)."""

    speed_shape: str
    speed_dtype: str
    speed_batch: int
    speed_context: int
    speed_steps: int
    speed_budget: int
    long_lengths: tuple[int, ...]
    long_steps: int
    long_batch: int
    long_dtype: str
    long_budget: int


FULL = Sizes("qwen3-4b", "bfloat16", 16, 16384, 128, 2048, (2048, 8192, 32768), 128, 16, "bfloat16", 512)
SMALL = Sizes("tiny", "float32", 2, 256, 8, 128, (512, 1024), 8, 1, "float32", 128)


# -- helpers ---------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_kwarg(model: Any, method: str = "forward") -> str:
    """transformers >= 5.24 names the cache argument ``cache``; older 5.x ``past_key_values``."""
    params = inspect.signature(getattr(model, method)).parameters
    return "cache" if "cache" in params else "past_key_values"


def generate(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, n: int) -> torch.Tensor:
    """Greedy generation of exactly ``n`` tokens through ``cache``."""
    kw = "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"
    with torch.inference_mode():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, **{kw: cache},
        )


def tiny_qwen3(device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """The tests' tiny random Qwen3 (2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 512)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, max_position_embeddings=8192, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def left_padded(batch: int, length: int, pads: tuple[int, ...], seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for r, p in enumerate(pads[:batch]):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids.to(device), mask.to(device)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])


# -- 1. exactness ------------------------------------------------------------------------------------
def exactness(device: torch.device, log) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        model = tiny_qwen3(device, dtype)
        ids, mask = left_padded(2, 20, (0, 5), 1, device)
        model.set_attn_implementation("sdpa")
        ref = generate(model, DynamicCache(config=model.config), ids, mask, 40)
        for name in EXACT_POLICIES:
            over = {"budget": 256} if name == "snapkv" else {"budget": 256, "recent": 8}
            got = generate(model, KVPolicyCache(kvpolicy.load_policy(name, **over), model), ids, mask, 40)
            model.set_attn_implementation("sdpa")
            step = first_difference(got[:, ids.shape[1]:], ref[:, ids.shape[1]:])
            out.append({"check": "budget above the length = DynamicCache", "policy": name, "dtype": dtype_name,
                        "passed": step is None, "first_difference": step})
        ids, mask = left_padded(2, 20, (0, 7), 2, device)
        for name in ALONE_POLICIES:
            over = {"budget": 32, "recent": 8} if name == "quest" else {"budget": 32, "recent": 8, "window": 8, "interval": 4}
            policy = kvpolicy.load_policy(name, **over)
            # End to end where the full cache is batch-invariant on this hardware and dtype, else
            # kvpolicy's part on replayed inputs (kvpolicy.hf.padded_rows).
            for row in check_padded_rows(model, policy, ids, mask, 48):
                out.append({"check": f"left-padded row {row.row} = the row alone ({policy.mode})", "policy": name,
                            "dtype": dtype_name, "passed": row.passed, "method": row.method,
                            "verdict": row.verdict, "detail": row.detail, "first_difference": row.first_difference,
                            "full_cache_parts_at": row.full_cache.tokens_from,
                            "full_cache_logits_differ_from": row.full_cache.logits_from})
            model.set_attn_implementation("sdpa")
        del model
        log(f"exactness {dtype_name}: {sum(c['passed'] for c in out if c['dtype'] == dtype_name)} of "
            f"{sum(c['dtype'] == dtype_name for c in out)} passed")
    return out


# -- 2. speed ----------------------------------------------------------------------------------------
def speed(sizes: Sizes, device: torch.device, caches: list[str], log) -> dict[str, Any]:
    dtype = getattr(torch, sizes.speed_dtype)
    t0 = time.perf_counter()
    model = gpu_decode_bench.build_model(sizes.speed_shape, dtype, device)
    log(f"built {sizes.speed_shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters) "
        f"in {time.perf_counter() - t0:.0f}s")
    kw = cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (sizes.speed_batch, sizes.speed_context), generator=gen).to(device)
    rows: dict[str, Any] = {}
    for name in caches:
        if name == "full":
            model.set_attn_implementation("sdpa")
            cache: Any = DynamicCache(config=model.config)
        else:
            policy = kvpolicy.load_policy(name, budget=sizes.speed_budget)
            if policy.mode == "evict":  # every timed step reads budget to budget + interval slots
                policy = kvpolicy.load_policy(name, budget=sizes.speed_budget, compress_prompt=True)
            cache = KVPolicyCache(policy, model)
        try:
            rows[name] = _decode_at_context(model, cache, prompt, sizes.speed_steps, device, kw)
        except torch.OutOfMemoryError:
            rows[name] = {"oom": True}
        del cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = rows[name]
        log(f"speed {name}: " + ("out of memory" if r.get("oom") else f"{r['tokens_per_s']:.1f} tok/s"))
    model.set_attn_implementation("sdpa")
    return {"settings": {k: getattr(sizes, k) for k in ("speed_shape", "speed_dtype", "speed_batch", "speed_context",
                                                         "speed_steps", "speed_budget")}, "rows": rows}


def _decode_at_context(model, cache, prompt: torch.Tensor, steps: int, device: torch.device, kw: str) -> dict:
    """Prefill ``prompt``, one untimed step (a compressing policy evicts the prompt), then
    ``steps`` timed decode steps; peak memory over it all and over the decode alone."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        token = long_decode_bench.prefill(model, cache, prompt, kw)
        sync(device)
        peak_prefill = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = long_decode_bench.decode_steps(model, cache, token, steps, kw, device)
    peak_decode = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "tokens_per_s": prompt.shape[0] * steps / seconds,
        "seconds": seconds,
        "peak_gib": None if peak_prefill is None else max(peak_prefill, peak_decode or 0) / 2**30,
        "decode_peak_gib": None if peak_decode is None else peak_decode / 2**30,
        "kv_gib": cache_bytes(cache) / 2**30,
    }


# -- 3. long context ---------------------------------------------------------------------------------
def long_context(sizes: Sizes, device: torch.device, log) -> dict[str, Any]:
    dtype = getattr(torch, sizes.long_dtype)
    results = long_decode_bench.run(
        list(sizes.long_lengths), list(long_decode_bench.CACHES), sizes.long_budget, sizes.long_steps, 1,
        sizes.long_batch, device, dtype, log=log, time_choosing=device.type == "cpu",
    )
    return {"settings": {k: getattr(sizes, k) for k in ("long_lengths", "long_steps", "long_batch", "long_dtype",
                                                         "long_budget")},
            "rows": {str(n): r for n, r in results.items()}}


# -- outputs -----------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "kvpolicy": kvpolicy.__version__, "device": str(device), "threads": torch.get_num_threads(),
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return env


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"# kvpolicy GPU check ({env['device']}{', ' + env['gpu'] if 'gpu' in env else ''})", "",
             f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
             f"flash-attn {'yes' if env['flash_attn'] else 'no'}; {report['seconds']:.0f} s in all.", ""]
    if "exactness" in report:
        lines += ["## Exactness", "", "| check | policy | dtype | result |", "|---|---|---|---|"]
        for c in report["exactness"]:
            if "verdict" in c:  # a padded-row check says which comparison applied, and why
                result = ("pass: " if c["passed"] else "FAIL: ") + c["verdict"]
            else:
                result = "pass" if c["passed"] else f"FAIL (first differing token {c['first_difference']})"
            lines.append(f"| {c['check']} | {c['policy']} | {c['dtype']} | {result} |")
        lines.append("")
    if "speed" in report:
        s = report["speed"]["settings"]
        lines += [f"## Decode speed at {s['speed_context']:,} tokens of context",
                  "", f"{s['speed_shape']} (random weights), {s['speed_dtype']}, batch {s['speed_batch']}, "
                  f"budget {s['speed_budget']}, {s['speed_steps']} decode steps timed after the prefill.", "",
                  "| cache | tokens/s | vs full | peak GiB (prefill incl.) | decode peak GiB | KV GiB |",
                  "|---|---|---|---|---|---|"]
        rows = report["speed"]["rows"]
        full = rows.get("full", {}).get("tokens_per_s")
        for name, r in rows.items():
            if r.get("oom"):
                lines.append(f"| {name} | out of memory | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / full:.2f}x" if full else "-"
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ratio} | {_gib(r['peak_gib'])} | "
                         f"{_gib(r['decode_peak_gib'])} | {r['kv_gib']:.2f} |")
        lines.append("")
    if "long_context" in report:
        s = report["long_context"]["settings"]
        rows = {int(n): r for n, r in report["long_context"]["rows"].items()}
        lines.append(long_decode_bench.table(
            rows, f"## Long context: selection against the full cache\n\nLlama (hidden 512, 2 layers, 8 heads of 64), "
                  f"{s['long_dtype']}, batch {s['long_batch']}, budget {s['long_budget']}, {s['long_steps']} decode steps."))
        lines.append("")
    for part, error in report.get("errors", {}).items():
        lines += [f"## {part}: FAILED", "", "```", error.strip(), "```", ""]
    return "\n".join(lines)


def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small sizes (CPU, CI): about a minute on 2 cores")
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.md (default runs/gpu-check-DEVICE)")
    ap.add_argument("--parts", nargs="*", default=["exactness", "speed", "long_context"],
                    choices=["exactness", "speed", "long_context"])
    ap.add_argument("--speed-caches", nargs="*", default=list(SPEED_CACHES))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default; 1 with --small)")
    args = ap.parse_args(argv)
    if args.threads or args.small:  # tiny models decode fastest on one thread
        torch.set_num_threads(args.threads or 1)
    # A bad device or output folder: one line now, not a traceback in the first part.
    try:
        device = torch.device(resolve_device(args.device))
    except EvalError as exc:
        ap.error(f"--device: {exc}")
    out = Path(args.out or f"runs/gpu-check-{device.type}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_output(out / "gpu_check.json", "--out")
    except OSError as exc:
        ap.error(f"--out {out}: {exc.strerror or exc}")
    sizes = SMALL if args.small else FULL
    start = time.perf_counter()
    report: dict[str, Any] = {"env": environment(device), "sizes": asdict(sizes), "errors": {}}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)

    def write() -> None:
        report["seconds"] = time.perf_counter() - start
        # whole files only: each part's write replaces the last, and a failed one keeps it
        replace_file(out / "gpu_check.json", json.dumps(report, indent=2).encode("utf-8"))
        replace_file(out / "gpu_check.md", markdown(report).encode("utf-8"))

    log(f"kvpolicy GPU check on {device} ({'small' if args.small else 'full'} sizes); writing to {out}")
    parts = {"exactness": lambda: exactness(device, log), "speed": lambda: speed(sizes, device, args.speed_caches, log),
             "long_context": lambda: long_context(sizes, device, log)}
    for part in args.parts:
        try:
            report[part] = parts[part]()
        except Exception:  # recorded, and the other parts still run: one run of a scarce machine
            report["errors"][part] = traceback.format_exc()
            log(f"{part} FAILED:\n{report['errors'][part]}")
        write()
    print()
    print(markdown(report))
    failed = [c for c in report.get("exactness", []) if not c["passed"]]
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
