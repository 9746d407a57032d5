"""What the vLLM integration supports, and the error it refuses with."""

from __future__ import annotations

#: The vLLM releases this integration is written against and tested with (``make test-vllm``).
SUPPORTED_VLLM = ((0, 32), (0, 33))  # >= 0.32, < 0.33
SUPPORTED_VLLM_TEXT = ">=0.32,<0.33"


class KVPolicyVLLMError(ValueError):
    """A kvpolicy setting, or a vLLM configuration it cannot serve, refused at start-up."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvpolicy[vllm]: {message}")
