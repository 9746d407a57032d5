"""Helpers shared by the tests that decode with transformers models (tiny, random, offline)."""

from __future__ import annotations

import copy
import warnings

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

# generate() names the cache argument `cache` from transformers 5.24 on; `past_key_values`
# before (and, deprecated, after). Tests use the name the installed version prefers.
_TF = tuple(int(x) for x in transformers.__version__.split(".")[:2])
CACHE_ARG = "cache" if _TF >= (5, 24) else "past_key_values"
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")


def tiny_qwen3(layers: int, vocab: int, hidden: int = 64, heads: int = 4, head_dim: int = 16, seed: int = 0):
    """A randomly initialised Qwen3 with 2 KV heads on sdpa attention, in eval mode."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=head_dim, vocab_size=vocab, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).eval()


def fresh(model):
    """A copy still on sdpa attention (KVPolicyCache switches the model it is given)."""
    m = copy.deepcopy(model)
    m.set_attn_implementation("sdpa")
    return m


def left_padded_prompt(vocab: int, batch: int = 2, length: int = 20, pads=(0, 5), seed: int = 0):
    """``(ids, mask)`` ``[B, T]``: random tokens, row ``r`` left-padded with ``pads[r]`` zeros."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for r, p in enumerate(pads[:batch]):
        ids[r, :p] = 0
        mask[r, :p] = 0
    return ids, mask


def generate(model, cache, ids, mask, n: int, **kw):
    """Greedy generation of exactly ``n`` tokens through ``cache``."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, **{CACHE_ARG: cache}, **kw,
        )


def assert_rows_decode_as_alone(model, policy, ids, mask, n: int) -> None:
    """Every row of the left-padded batch decodes under ``policy`` as it does alone: end to end
    where the full cache is batch-invariant on this machine, else on replayed inputs (the rule
    and its report: ``kvpolicy.hf.padded_rows``)."""
    from kvpolicy.hf.padded_rows import check_padded_rows

    rows = check_padded_rows(model, policy, ids, mask, n)
    assert all(row.passed for row in rows), [f"row {row.row}: {row.verdict} ({row.detail})" for row in rows]
