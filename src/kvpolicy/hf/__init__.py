"""Hugging Face transformers integration: ``KVPolicyCache`` and the ``"kvpolicy"`` attention.

Importing this package imports transformers but registers nothing; ``register()`` (called by
``KVPolicyCache``) adds ``"kvpolicy"`` to ``AttentionInterface`` and ``AttentionMaskInterface``.
"""

from .attention import ATTN_IMPLEMENTATION, kvpolicy_attention, kvpolicy_mask, register
from .cache import KVPolicyCache, KVPolicyLayer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KVPolicyCache",
    "KVPolicyLayer",
    "kvpolicy_attention",
    "kvpolicy_mask",
    "register",
]
