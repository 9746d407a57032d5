"""GPU decode throughput and peak memory: full cache versus rkv, vase-attnv and vase-dkv.

A randomly initialised model of Qwen3-4B's shape (no weights to download: the config is built in
code), bf16, batch 16, a random prompt, greedy decoding of a fixed number of tokens (no EOS), with
transformers' ``DynamicCache`` (full) and ``KVPolicyCache`` at budget 2048. Reports tokens/s
(batch x new tokens / wall time), ``torch.cuda.max_memory_allocated`` and the KV bytes held.
The full cache may run out of memory at long outputs: that is reported, not raised.

Usage (defaults are the paper-style setting; shrink them for a smoke run)::

    python benchmarks/gpu_decode_bench.py                                   # 16k tokens, batch 16
    python benchmarks/gpu_decode_bench.py --max-new 2048 --budget 512       # a few minutes
    python benchmarks/gpu_decode_bench.py --shape tiny --device cpu --dtype float32 \\
        --batch 2 --max-new 96 --budget 32 --recent 8 --interval 8 --window 8 --prompt 16  # CPU smoke
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.eval.cost import cache_bytes  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402

SHAPES = {
    # Qwen3-4B (config.json of Qwen/Qwen3-4B)
    "qwen3-4b": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # Qwen3-14B
    "qwen3-14b": dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=40960,
    ),
}


def build_model(shape: str, dtype: torch.dtype, device: torch.device) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise directly in the target dtype (no fp32 copy)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def _cache_kwarg(model) -> str:
    """transformers >= 5.24 names the forward's cache argument ``cache``; older 5.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(model, cache, prompt: torch.Tensor, max_new: int, device: torch.device) -> dict:
    """Prefill, then ``max_new - 1`` single-token steps; timings exclude the prefill."""
    kw = _cache_kwarg(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kw: cache})
        token = out.logits[:, -1:].argmax(-1)
        del out
        _sync(device)
        start = time.perf_counter()
        for _ in range(max_new - 1):
            out = model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache})
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "tokens_per_s": prompt.shape[0] * (max_new - 1) / seconds,
        "seconds": seconds,
        "peak_gib": None if peak is None else peak / 2**30,
        "kv_gib": cache_bytes(cache) / 2**30,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=2048)
    for field in ("recent", "interval", "window"):
        ap.add_argument(f"--{field}", type=int, default=None, help=f"override every policy's {field} (smoke runs)")
    ap.add_argument("--policies", nargs="*", default=["full", "rkv", "vase-attnv", "vase-dkv"])
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    t0 = time.perf_counter()
    model = build_model(args.shape, dtype, device)
    print(f"built {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {args.dtype}) "
          f"on {device} in {time.perf_counter() - t0:.0f}s", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    # Warm-up: kernels and allocator, short.
    model.set_attn_implementation("sdpa")
    decode(model, DynamicCache(config=model.config), prompt, 8, device)

    results = {}
    for name in args.policies:
        if name == "full":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            over = {f: getattr(args, f) for f in ("recent", "interval", "window") if getattr(args, f) is not None}
            cache = KVPolicyCache(kvpolicy.load_policy(name, budget=args.budget, **over), model)
        try:
            results[name] = decode(model, cache, prompt, args.max_new, device)
        except torch.OutOfMemoryError:
            results[name] = {"oom": True}
        del cache
        r = results[name]
        print(f"{name}: " + ("out of memory" if r.get("oom") else
              f"{r['tokens_per_s']:.1f} tok/s, {r['seconds']:.0f}s, peak "
              + ("-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB") + f", KV {r['kv_gib']:.2f} GiB"),
              flush=True)

    print(f"\n{args.shape} {args.dtype}, batch {args.batch}, prompt {args.prompt}, {args.max_new} new tokens, "
          f"budget {args.budget}, {device}, torch {torch.__version__}")
    print(f"{'cache':<12}{'tokens/s':>12}{'peak GiB':>12}{'KV GiB':>10}")
    for name, r in results.items():
        if r.get("oom"):
            print(f"{name:<12}{'OOM':>12}")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"{name:<12}{r['tokens_per_s']:>12.1f}{peak:>12}{r['kv_gib']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
