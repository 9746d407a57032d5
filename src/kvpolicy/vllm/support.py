"""What the vLLM integration supports, and the error it refuses with."""

from __future__ import annotations

#: The vLLM releases this integration is written against and tested with (``make test-vllm``).
SUPPORTED_VLLM = ((0, 32), (0, 33))  # >= 0.32, < 0.33
SUPPORTED_VLLM_TEXT = ">=0.32,<0.33"


class KVPolicyVLLMError(ValueError):
    """A kvpolicy setting, or a vLLM configuration it cannot serve, refused at start-up."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvpolicy[vllm]: {message}")


class KVPolicyInvariantError(RuntimeError):
    """An invariant the integration's memory accounting relies on is broken (a bug, not a setting):
    raised, never asserted, so that ``python -O`` keeps it; the step stops instead of reading or
    writing blocks that another request holds."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvpolicy[vllm] internal invariant broken: {message}")
