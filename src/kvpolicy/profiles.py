"""Measuring a head profile of a transformers decoder (``kvpolicy profile`` runs this).

``compute_profile`` measures a ``HeadProfile`` in one forward pass over a calibration text, and
``concentration_calibration`` / ``passkey_calibration`` build that text's token ids. The file
format itself (``HeadProfile``, ``ProfileError``, ``PROFILE_FORMAT``, ``CLASS_WEIGHTS``) lives in
``kvpolicy.profile_format``, which the ``profile`` allocation reads without this module; it is
re-exported here, so ``from kvpolicy.profiles import HeadProfile, compute_profile`` keeps working.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .profile_format import CLASS_WEIGHTS, PROFILE_FORMAT, HeadProfile, ProfileError

__all__ = [
    "CLASS_WEIGHTS",
    "METHODS",
    "PASSKEY_HEAD",
    "PASSKEY_QUESTION",
    "PASSKEY_TAIL",
    "PROFILE_FORMAT",
    "Calibration",
    "HeadProfile",
    "Method",
    "ProfileError",
    "check_token_ids",
    "compute_profile",
    "concentration_calibration",
    "passkey_calibration",
]

METHODS = ("concentration", "passkey")
Method = Literal["concentration", "passkey"]


@dataclass(frozen=True)
class Calibration:
    """Token ids to profile a model on, and what ``compute_profile`` scores in them.

    ``window``: how many final positions' queries are scored. ``key_span``: ``(start, end)``
    positions of the passkey's tokens (``passkey`` method only). ``description``: for reports.
    """

    input_ids: list[int]
    window: int
    key_span: tuple[int, int] | None
    description: str


def concentration_calibration(tokenizer, text: str, tokens: int, window: int = 32) -> Calibration:
    """The first ``tokens`` tokens of ``text``, scored at its last ``window`` queries."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokens <= window:
        raise ValueError(f"tokens ({tokens}) must exceed the window ({window})")
    if len(ids) < tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than the {tokens} asked for")
    return Calibration(list(ids[:tokens]), window, None, f"{tokens} tokens, last {window} queries")


#: The planted sentence is PASSKEY_HEAD, a space and the key, then PASSKEY_TAIL.
PASSKEY_HEAD = " The pass key is"
PASSKEY_TAIL = ". Remember it."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def passkey_calibration(tokenizer, text: str, tokens: int, seed: int = 0, depth: float = 0.5) -> Calibration:
    """A passkey planted in ``text`` and asked for at the end, with the answer teacher-forced.

    The ids are: the text's first tokens, with the sentence ``PASSKEY_HEAD`` + key +
    ``PASSKEY_TAIL`` (a 5-digit key drawn from ``seed``) inserted at the fraction ``depth`` of
    them, then ``PASSKEY_QUESTION`` and the key's tokens but the last, ``tokens`` ids in all. The scored queries are the last ``A`` positions
    (``A`` = the key's token count): the ones whose next token is a token of the key. ``key_span``
    covers the key's tokens in the needle.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(random.Random(f"kvpolicy-profile-passkey-{seed}").randint(10000, 99999))

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    head_ids = encode(PASSKEY_HEAD)
    with_key = encode(f"{PASSKEY_HEAD} {key}")
    if with_key[: len(head_ids)] != head_ids:  # the span below would be off
        raise ValueError("the tokenizer merges the passkey with the words before it; cannot locate its tokens")
    key_ids = with_key[len(head_ids):]  # the key as it follows "is" (a leading space token included)
    tail_ids, question = encode(PASSKEY_TAIL), encode(PASSKEY_QUESTION)
    fixed = len(with_key) + len(tail_ids) + len(question) + len(key_ids) - 1
    room = tokens - fixed
    if room < 2:
        raise ValueError(f"tokens ({tokens}) leave no room for text around the passkey ({fixed} tokens)")
    filler = encode(text)
    if len(filler) < room:
        raise ValueError(f"the calibration text has {len(filler)} tokens, fewer than the {room} needed")
    cut = round(depth * room)
    start = cut + len(head_ids)
    ids = filler[:cut] + with_key + tail_ids + filler[cut:room] + question + key_ids[:-1]
    return Calibration(ids, len(key_ids), (start, start + len(key_ids)),
                       f"{tokens} tokens, passkey {key} at depth {depth:g}")


def check_token_ids(model: Any, ids: torch.Tensor) -> None:
    """``ValueError`` unless every id of ``ids`` has a row in ``model``'s input embedding, naming
    the largest id and the vocabulary size. A folder whose tokenizer has a larger vocabulary than
    its model (the converter's tiny Qwen3 ships SmolLM2's) would otherwise fail deep inside the
    embedding, with an ``IndexError`` that names neither."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embedding, "num_embeddings", None)
    if not isinstance(size, int) or ids.numel() == 0:
        return  # no embedding to check against: the model reports what it finds
    largest, smallest = int(ids.max()), int(ids.min())
    if largest >= size or smallest < 0:
        bad = largest if largest >= size else smallest
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {size} (ids 0 to {size - 1}): "
                         "the tokenizer does not match the model (use the model's own tokenizer, or a text whose "
                         "tokens the model has)")


def compute_profile(
    model: Any,
    input_ids: torch.Tensor | Sequence[int],
    method: Method = "concentration",
    *,
    window: int = 32,
    key_span: tuple[int, int] | None = None,
    model_name: str | None = None,
) -> HeadProfile:
    """Measure a ``HeadProfile`` of a transformers decoder in one forward pass over ``input_ids``.

    The model runs once, without a cache, on eager attention (its attention implementation, and
    train/eval mode, are restored afterwards); a hook on each layer's attention module reads the
    attention weights ``A`` (``[Hq, T, T]``, row ``t`` a softmax over keys ``0..t``) as the layer
    runs, so only one layer's weights are held at a time. With ``Q`` the last ``window`` query
    positions and ``G = Hq / Hkv`` query heads per KV head (query head ``h`` reads KV head
    ``h // G``), the weight of (layer ``l``, KV head ``k``), in float64, is the mean over the
    ``G`` query heads of KV head ``k`` and over ``t`` in ``Q`` of:

    - ``concentration``: the normalised entropy of the row,
      ``-sum_j A[t, j] log A[t, j] / log(t + 1)``, in ``[0, 1]``: 0 when a head reads one key, 1
      when it spreads evenly over all ``t + 1``. Spread heads get high weights (Ada-KV gives them
      more slots).
    - ``passkey``: the attention mass on the passkey's tokens, ``sum_{j in key_span} A[t, j]``,
      in ``[0, 1]`` (a retrieval score in the spirit of HeadKV and DuoAttention); with
      ``passkey_calibration``'s ids, ``Q`` are the positions that predict the key.

    Args:
        model: a transformers causal LM whose attention modules have ``layer_idx`` and return
            their weights on eager attention (Llama, Qwen, Mistral, SmolLM, ...).
        input_ids: ``[T]`` or ``[1, T]`` token ids (one row, no padding).
        method: ``"concentration"`` or ``"passkey"``.
        window: how many final positions' queries are scored, ``1 <= window < T``.
        key_span: ``(start, end)`` positions of the passkey's tokens, before the scored queries
            (``passkey`` only).
        model_name: written to the profile's ``model`` field (default: the model's
            ``name_or_path``).

    Returns:
        A weight profile of ``[num_hidden_layers, num_key_value_heads]``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown profile method {method!r}; methods: {', '.join(METHODS)}")
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T] (one row), got shape {list(ids.shape)}")
    check_token_ids(model, ids)
    length = ids.shape[0]
    if not 1 <= window < length:
        raise ValueError(f"window must be in [1, {length - 1}] for {length} tokens, got {window}")
    first_query = length - window
    if method == "passkey":
        if key_span is None:
            raise ValueError("the passkey method needs key_span, the (start, end) positions of the passkey")
        start, end = key_span
        if not 0 <= start < end <= first_query:
            raise ValueError(f"key_span {key_span} must satisfy 0 <= start < end <= {first_query} "
                             f"(the passkey comes before the {window} scored queries)")
    elif key_span is not None:
        raise ValueError("key_span is for the passkey method only")

    span = key_span or (0, 0)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = int(config.num_hidden_layers)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    scores: dict[int, torch.Tensor] = {}

    def reduce(attn: torch.Tensor) -> torch.Tensor:
        rows = attn[0, :, first_query:, :].to(torch.float64)  # [Hq, W, T]
        if method == "concentration":
            visible = torch.arange(first_query, length, dtype=torch.float64, device=rows.device) + 1
            per_query = torch.special.entr(rows).sum(-1) / visible.log()  # [Hq, W]
        else:
            per_query = rows[..., span[0]:span[1]].sum(-1)
        heads = per_query.mean(-1)  # [Hq]
        if heads.shape[0] % num_kv_heads:
            raise ValueError(f"{heads.shape[0]} query heads do not split into {num_kv_heads} KV heads")
        return heads.view(num_kv_heads, -1).mean(-1).cpu()  # [Hkv]

    def hook(module, args, output) -> None:
        layer = module.layer_idx
        if layer in scores or not isinstance(output, tuple) or len(output) < 2:
            return  # the innermost module with this layer_idx (the attention) ran first
        attn = output[1]
        if isinstance(attn, torch.Tensor) and attn.dim() == 4 and attn.shape[-2:] == (length, length):
            scores[layer] = reduce(attn)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int)]
    previous = model.config._attn_implementation
    was_training = model.training
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the logits of every position are not needed (T x vocab floats)
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} cannot switch to eager attention (no set_attn_implementation)")
    try:
        model.set_attn_implementation("eager")
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[None].to(device), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
        model.train(was_training)
    missing = [i for i in range(num_layers) if i not in scores]
    if missing:
        raise ValueError(
            f"{type(model).__name__} returned no attention weights for layers {missing[:8]}: compute_profile needs "
            "attention modules with a layer_idx that return their weights on eager attention"
        )
    weights = torch.stack([scores[i] for i in range(num_layers)])
    name = model_name if model_name is not None else str(getattr(config, "name_or_path", "") or type(model).__name__)
    return HeadProfile.from_weights(weights, model=name, method=method)
