"""Long-context decoding: selection's speed against the full cache and the eviction floor.

The setting selection exists for: a long context prefilled densely, then decode steps that
read only what the policy chooses. One run, side by side: an attention-heavy random Llama
(hidden 512, 2 layers, 8 heads of 64, 8 KV heads, MLP 1024, vocab 1024: at long context
attention is most of a step) prefills a random prompt of each length in one chunk, then a
plain loop times ``--steps`` decode steps (greedy; the prefill is not timed), for:

- ``full``: transformers' ``DynamicCache`` (it concatenates each step's keys and values onto
  the cache, copying all of it at every step: at long context that copy costs more than the
  attention);
- ``dense``: every slot attended from preallocated buffers, with no per-step copy (a
  ``KVPolicyCache`` of ``oracle-topk`` at a budget above any length: select mode that never
  chooses): what reading all ``N`` keys and values costs;
- the eviction floor: ``streamingllm`` at the budget with ``compress_prompt`` (evict mode, no
  scoring: what reading ``budget`` to ``budget + interval`` slots costs; the prompt is evicted
  down to the budget before the timed steps);
- ``quest``, ``oracle-topk`` and ``vase-attnv@select`` (select mode: every token kept, each
  step attends ``budget`` chosen slots);
- ``quest-pages``: ``quest`` with ``granularity: page`` (Quest's own rule: each step ranks the
  ``N / 16`` whole pages by their bound and attends the best of them whole, plus the recent
  buffer and the last, short page; see ``docs/selection.md``).

Reported: decode tokens/s, its ratio to the full cache and to ``dense`` at each length, and for the selection
policies the share of decode time spent choosing (the executor's ``timer("select")`` hook:
building the choice's input, scoring and top-k). The caches alternate within one process, so
machine noise hits them alike; each is timed ``--trials`` times and the best trial is kept.

Usage::

    python benchmarks/long_decode_bench.py                        # 2K, 8K, 32K (several minutes)
    python benchmarks/long_decode_bench.py --lengths 8192 --steps 64
    python benchmarks/long_decode_bench.py --device cuda --dtype bfloat16 --threads 0
"""

from __future__ import annotations

import argparse
import inspect
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy.eval.cost import PolicyTimer, time_policy  # noqa: E402
from kvpolicy.hf import KVPolicyCache  # noqa: E402
from kvpolicy.schedule import MAX_SLOTS  # noqa: E402

CACHES = ("full", "dense", "streamingllm", "quest", "quest-pages", "oracle-topk", "vase-attnv@select")
SELECTING = {"quest", "quest-pages", "oracle-topk", "vase-attnv@select"}


def quest_pages(budget: int) -> kvpolicy.Policy:
    """``quest`` at ``budget`` choosing whole pages (``granularity: page``), named ``quest-pages``."""
    data = kvpolicy.load_policy("quest", budget=budget).config.to_dict()
    return kvpolicy.load_policy({**data, "name": "quest-pages", "scorer": {**data["scorer"], "granularity": "page"}})

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(device: torch.device, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    """The attention-heavy random Llama of issue 16, on ``device`` in ``dtype``."""
    cfg = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, head_dim=64, vocab_size=1024, max_position_embeddings=max_positions,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _cache_kwarg(model) -> str:
    """transformers >= 5.24 names the forward's cache argument ``cache``; older 5.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(name: str, model, budget: int):
    if name == "full":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    if name == "dense":  # a budget above any length: nothing is ever chosen, every slot attended
        return KVPolicyCache(kvpolicy.load_policy("oracle-topk", budget=MAX_SLOTS), model)
    if name == "quest-pages":
        return KVPolicyCache(quest_pages(budget), model)
    # The floor compresses the prompt once it is in: every timed step then reads at most
    # budget + interval slots (without it the prompt stays whole until the next interval).
    over = {"compress_prompt": True} if name == "streamingllm" else {}
    return KVPolicyCache(kvpolicy.load_policy(name, budget=budget, **over), model)


def prefill(model, cache, prompt: torch.Tensor, kw: str) -> torch.Tensor:
    """Prefill ``prompt`` densely, then one untimed decode step (a compressing policy evicts the
    prompt there; allocators warm up); returns the next tokens ``[B, 1]``. Call under
    ``torch.inference_mode``; ``kw``: the forward's cache argument (``_cache_kwarg``)."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kw: cache})
    token = out.logits[:, -1:].argmax(-1)
    del out
    out = model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache})
    return out.logits[:, -1:].argmax(-1)


def time_decode(
    model, cache, prompt: torch.Tensor, steps: int, device: torch.device, time_choosing: bool = True,
) -> tuple[float, float]:
    """Prefill ``prompt`` densely, then time ``steps`` decode steps: ``(seconds, choosing seconds)``
    (``time_choosing``: time the policy's choices through the executor's timer hook)."""
    kw = _cache_kwarg(model)
    timer = PolicyTimer(device, kinds=("select",) if time_choosing else ())
    with torch.inference_mode():
        token = prefill(model, cache, prompt, kw)
        _sync(device)
        with time_policy(cache, timer):
            seconds = decode_steps(model, cache, token, steps, kw, device)
        return seconds, timer.seconds["select"]


def decode_steps(model, cache, token: torch.Tensor, steps: int, kw: str, device: torch.device) -> float:
    """Seconds for ``steps`` greedy decode steps from ``token`` (the device synchronised at the
    end; under ``torch.inference_mode``; ``kw`` as for ``prefill``)."""
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache})
        token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    return time.perf_counter() - start


def run(
    lengths: list[int], caches: list[str], budget: int, steps: int, trials: int, batch: int,
    device: torch.device, dtype: torch.dtype, log=print, time_choosing: bool = True,
) -> dict[int, dict[str, dict[str, float | None]]]:
    """``{length: {cache: {"tok_s", "ratio", "choosing"}}}``, measured side by side.

    ``time_choosing``: time each choice (on a GPU that synchronises at every call, which slows
    the selection policies down: the GPU check turns it off)."""
    model = build_model(device, dtype, max(lengths) + steps + 16)
    vocab = model.config.vocab_size
    try:
        results: dict[int, dict[str, dict[str, float | None]]] = {}
        for n in lengths:
            prompt = torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(n)).to(device)
            best: dict[str, tuple[float, float]] = {}
            for _ in range(trials):
                for name in caches:
                    cache = make_cache(name, model, budget)
                    seconds, choosing = time_decode(model, cache, prompt, steps, device, time_choosing)
                    del cache
                    if name not in best or seconds < best[name][0]:
                        best[name] = (seconds, choosing)
            full = best.get("full", (float("nan"), 0.0))[0]
            dense = best.get("dense", (float("nan"), 0.0))[0]
            results[n] = {
                name: {
                    "tok_s": batch * steps / s, "ratio": full / s, "ratio_dense": dense / s,
                    "choosing": c / s if name in SELECTING and time_choosing else None,
                }
                for name, (s, c) in best.items()
            }
            log(f"{n} tokens: " + ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in results[n].items())
                + " (ratios to full)")
        return results
    finally:
        model.set_attn_implementation("sdpa")


def table(results: dict[int, dict[str, dict[str, float | None]]], title: str) -> str:
    """A markdown table: tok/s (ratio to full) per length, and the share of a step spent choosing."""
    lengths = list(results)
    names = list(next(iter(results.values())))
    lines = [title, "", "tok/s (ratio to full; to dense)", "",
             "| cache | " + " | ".join(f"{n:,} tokens" for n in lengths) + " | choosing (share of a step) |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for name in names:
        cells = [f"{r['tok_s']:.1f} ({r['ratio']:.2f}x; {r['ratio_dense']:.2f}x)"
                 for r in (results[n][name] for n in lengths)]
        shares = [results[n][name]["choosing"] for n in lengths]
        share = " / ".join("-" if c is None else f"{100 * c:.0f} %" for c in shares) if name in SELECTING else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {share} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768])
    ap.add_argument("--caches", nargs="*", default=list(CACHES))
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per cache and length")
    ap.add_argument("--trials", type=int, default=1, help="timed runs per cache (the best is kept)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = run(args.lengths, args.caches, args.budget, args.steps, args.trials, args.batch, device, dtype)
    print()
    print(table(results, f"Llama (hidden 512, 2 layers, 8 heads of 64), {args.dtype} on {device}, batch {args.batch}, "
                         f"budget {args.budget}, {args.steps} decode steps, {torch.get_num_threads()} thread(s), "
                         f"torch {torch.__version__}"))


if __name__ == "__main__":
    main()
