"""Measuring a query calibration of a transformers decoder (``kvpolicy calibrate`` runs this).

``measure_query_calibration`` runs the model once over a calibration text and records, per
(layer, query head), the statistics of its pre-RoPE queries that TriAttention's scorer reads
(``kvpolicy.stages.triattention.QueryCalibration``): the mean ``E[q_f]`` and the mean modulus
``E|q_f|`` of each RoPE frequency pair. The queries are the ones the model's attention receives
(after ``q_norm`` where the model has one), taken back to before RoPE with the model's own rotary
embedding (``ModelFacts.rope``), so the statistics describe the queries the scorer stands for.
"""

from __future__ import annotations

from typing import Any

import torch

from .hf.facts import model_facts
from .profiles import check_token_ids
from .stages.model_facts import unrotate
from .stages.triattention import QueryCalibration

#: The attention implementation registered for the measuring pass (sdpa, with the queries read).
CAPTURE_IMPLEMENTATION = "kvpolicy_calibrate"


def measure_query_calibration(model: Any, input_ids: torch.Tensor | list[int], *, text: str = "") -> QueryCalibration:
    """The query calibration of ``model`` on ``input_ids`` (``[T]`` or ``[1, T]``, one row, no padding).

    Every position's query counts (statistics in float64). Raises ``ValueError`` when the model's
    RoPE is unknown to kvpolicy (``kvpolicy.hf.facts``) or a layer's attention did not run
    through transformers' attention interface.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"input_ids must be [T] or [1, T] with T >= 2, got shape {list(ids.shape)}")
    check_token_ids(model, ids)
    facts = model_facts(model)
    if "rope" not in facts.available:
        raise ValueError(f"cannot calibrate {facts.name!r}: its RoPE is unknown ({facts.why_missing('rope')})")
    length = ids.numel()
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def capture(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        positions = torch.arange(query.shape[2], device=query.device)
        cos, sin = facts.rope(positions)
        pre = unrotate(query[0].double(), cos.double(), sin.double())  # [Hq, T, D]
        half = pre.shape[-1] // 2
        pairs = torch.complex(pre[..., :half], pre[..., half:])
        sums[layer] = (pairs.mean(1).cpu(), pairs.abs().mean(1).cpu())
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, capture)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    was_training = model.training
    device = next(model.parameters()).device
    try:
        model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    missing = [i for i in range(facts.num_layers) if i not in sums]
    if missing:
        raise ValueError(
            f"{type(model).__name__}: layers {missing[:8]} did not run through transformers' attention interface, "
            "so their queries could not be read"
        )
    q_mean = torch.stack([sums[i][0] for i in range(facts.num_layers)])
    q_abs = torch.stack([sums[i][1] for i in range(facts.num_layers)])
    return QueryCalibration.measured(facts, q_mean, q_abs, method="query_frequency", text=text, tokens=str(length))
