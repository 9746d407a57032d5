"""H2O through transformers' generate() against a float64 model that accumulates every query's
exact attention weights at every step, and state moving with rows (padding, beams)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_util import CACHE_ARG, assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3  # noqa: E402
from hf_util import generate as _generate  # noqa: E402
from transformers import AttentionInterface, LogitsProcessor, LogitsProcessorList  # noqa: E402

from kvpolicy import KVPolicyCache, load_policy  # noqa: E402

VOCAB = 1024
pytestmark = pytest.mark.usefixtures("one_thread")


def _h2o(**extra):
    return load_policy("h2o", **{"budget": 16, "recent": 4, "interval": 4, "window": 4, **extra})


class _Held(LogitsProcessor):
    """The positions each layer and KV head held when the step's query attended."""

    def __init__(self, cache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores):
        self.steps.append([(s.positions.clone(), s.valid.clone()) for s in self.cache.evicting.layers])
        return scores


_MASKS: dict[int, torch.Tensor] = {}
_PROBS: dict[int, torch.Tensor] = {}


def _recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the whole sequence with each query's own mask (``_MASKS[layer] [B, Hkv, T,
    T]``), in float64; keeps the probabilities of every query (``_PROBS``)."""
    mask = _MASKS[module.layer_idx]
    g = query.shape[1] // key.shape[1]
    logits = query.double() @ key.repeat_interleave(g, 1).double().transpose(-1, -2) * scaling
    probs = torch.softmax(logits.masked_fill(~mask.repeat_interleave(g, 1), float("-inf")), -1).nan_to_num(0.0)
    _PROBS[module.layer_idx] = probs
    out = probs @ value.repeat_interleave(g, 1).double()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _h2o_reference(model, policy, seq, mask, n):
    """H2O in float64 over the tokens ``seq`` (prompt then ``n`` decoded), the model re-run on the
    whole sequence at every step with each query's mask: every query adds its exact attention
    weights (softmax over the tokens held at its step, summed over the group's query heads) to
    the tokens it saw, from the prompt's first query on; a due row keeps its ``recent`` newest
    tokens and the top others by accumulated attention. Returns ``(held, logits)``: per step and
    layer, the ``[B, Hkv]`` sets of padded indices the step's query saw, and its logits."""
    s = policy.schedule
    ref = copy.deepcopy(model).double()
    AttentionInterface.register("kvpolicy_h2o_reference", _recording_attention)
    ref.set_attn_implementation("kvpolicy_h2o_reference")
    cfg = model.config
    n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    g = cfg.num_attention_heads // hkv
    b, total = seq.shape
    p = mask.shape[1]
    full_mask = torch.cat([mask, torch.ones(b, n, dtype=mask.dtype)], 1).bool()
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
    rows = (causal & full_mask[:, None, :])[:, None].expand(b, hkv, total, total).clone()
    masks = {layer: rows.clone() for layer in range(n_layers)}
    held = {layer: [[set(full_mask[r, :p].nonzero().flatten().tolist()) for _ in range(hkv)] for r in range(b)]
            for layer in range(n_layers)}
    acc = {layer: torch.zeros(b, hkv, total, dtype=torch.float64) for layer in range(n_layers)}
    tokens = mask.sum(1).tolist()
    seen_held, seen_logits = [], []
    for step in range(n):
        length = p + step
        q = length - 1
        for layer in range(n_layers):
            if step:
                for r in range(b):
                    for h in range(hkv):
                        held[layer][r][h].add(q)
                        row = torch.zeros(total, dtype=torch.bool)
                        row[list(held[layer][r][h])] = True
                        masks[layer][r, h, q] = row
            _MASKS[layer] = masks[layer][:, :, :length, :length]
        position_ids = (full_mask[:, :length].long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = ref(input_ids=seq[:, :length], position_ids=position_ids,
                         attention_mask=full_mask[:, :length].long()).logits
        seen_logits.append(logits[:, q])
        seen_held.append([[[sorted(held[layer][r][h]) for h in range(hkv)] for r in range(b)] for layer in range(n_layers)])
        queries = range(p) if step == 0 else [q]
        for layer in range(n_layers):
            probs = _PROBS[layer]  # [B, Hq, T, T]
            for r in range(b):
                for i in queries:
                    if not full_mask[r, i]:
                        continue
                    acc[layer][r, :, :length] += probs[r, :, i].view(hkv, g, length).sum(1)
        for r in range(b):
            if step:
                tokens[r] += 1
            for layer in range(n_layers):
                count = len(held[layer][r][0])
                if not bool(s.due(count, tokens[r], prompt=step == 0)):
                    continue
                for h in range(hkv):
                    order = sorted(held[layer][r][h])
                    old, recent = order[: len(order) - s.recent], order[len(order) - s.recent:]
                    best = sorted(old, key=lambda i: -float(acc[layer][r, h, i]))[: s.budget - s.recent]
                    held[layer][r][h] = set(best) | set(recent)
    return seen_held, seen_logits


@pytest.mark.parametrize("heads", [2, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("compress_prompt", [False, True])
def test_h2o_generate_equals_float64_reference(heads, compress_prompt):
    """Every step's held tokens, per layer and KV head, equal the reference's, and the logits
    agree: a left-padded prompt of 24 (six times the window), 40 tokens, several evictions."""
    model = tiny_qwen3(layers=2, vocab=VOCAB, heads=heads, head_dim=16, seed=1)
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=24, pads=(0, 5), seed=3)
    n = 40
    policy = _h2o(compress_prompt=compress_prompt)
    run = fresh(model)
    cache = KVPolicyCache(policy, run)
    snap = _Held(cache)
    with torch.no_grad():
        out = run.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, **{CACHE_ARG: cache}, output_logits=True, return_dict_in_generate=True,
                           logits_processor=LogitsProcessorList([snap]))
    assert min(st.evictions for st in cache.stats()) >= 5
    held, logits = _h2o_reference(model, policy, out.sequences, mask, n)
    pads = (1 - mask).sum(1)
    for step, layers in enumerate(snap.steps):
        for layer, (positions, valid) in enumerate(layers):
            for r in range(2):
                for h in range(positions.shape[1]):
                    got = sorted((positions[r, h][valid[r, h]] + pads[r]).tolist())
                    assert got == held[step][layer][r][h], (step, layer, r, h)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(logits, 1).float(), atol=2e-4, rtol=1e-4)


def test_h2o_padded_rows_decode_as_alone():
    model = tiny_qwen3(layers=2, vocab=VOCAB, seed=2)
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=20, pads=(0, 7), seed=4)
    assert_rows_decode_as_alone(model, _h2o(), ids, mask, 48)


def test_h2o_beams_and_return_sequences_equal_rows_alone():
    """Beam search with several returned sequences reorders rows (state included) at every step:
    a batch of two prompts gives each the beams it gets alone."""
    model = tiny_qwen3(layers=2, vocab=VOCAB, seed=3)
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=16, pads=(0, 0), seed=5)
    kw = {"num_beams": 3, "num_return_sequences": 2}
    run = fresh(model)
    cache = KVPolicyCache(_h2o(), run)
    both = _generate(run, cache, ids, mask, 40, **kw)
    assert cache.stats()[0].evictions >= 4
    for r in range(2):
        alone = _generate(run, KVPolicyCache(_h2o(), run), ids[r : r + 1], mask[r : r + 1], 40, **kw)
        assert torch.equal(both[2 * r : 2 * r + 2], alone), r
