"""Hugging Face transformers integration: ``KVPolicyCache`` and the ``"kvpolicy"`` attention.

Importing this package imports transformers but registers nothing; ``register()`` (called by
``KVPolicyCache``) adds ``"kvpolicy"`` to ``AttentionInterface`` and ``AttentionMaskInterface``.
A model on ``"kvpolicy"`` serves any other cache (or none) as the implementation it replaced
(``replaced_implementation``), exactly.
"""

from .attention import (
    ATTN_IMPLEMENTATION,
    kvpolicy_attention,
    kvpolicy_mask,
    register,
    replaced_implementation,
)
from .cache import KVPolicyCache, KVPolicyLayer
from .facts import model_facts

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KVPolicyCache",
    "KVPolicyLayer",
    "kvpolicy_attention",
    "kvpolicy_mask",
    "model_facts",
    "register",
    "replaced_implementation",
]
