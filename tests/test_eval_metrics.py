"""The evaluation harness's measures on small cases that can be checked by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import Schedule, load_policy
from kvpolicy.eval.config import EvalConfig, EvalError, apply_sets
from kvpolicy.eval.metrics import METRICS, get_metrics
from kvpolicy.eval.metrics.fidelity import first_divergence, token_agreement
from kvpolicy.eval.metrics.passkey import parse_passkey, passkey_correct
from kvpolicy.eval.metrics.perplexity import perplexity, token_nll
from kvpolicy.eval.metrics.reconstruction import (
    Reconstruction,
    attention_output,
    kept_slots,
    reconstruction_error,
    relative_error,
)
from kvpolicy.eval.reasoning import repeated_ngram_share


# -- perplexity ---------------------------------------------------------------------------------------
def test_perplexity_from_known_logits():
    # position 0: uniform over 2 tokens -> p(target 0) = 1/2
    # position 1: logits (ln 3, 0) -> p(target 0) = 3/4
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    nll = token_nll(logits, torch.tensor([0, 0]))
    assert nll.tolist() == pytest.approx([math.log(2), math.log(4 / 3)])
    assert perplexity(float(nll.sum()), 2) == pytest.approx(math.sqrt(2 * 4 / 3))


def test_perplexity_of_a_certain_prediction_is_one():
    logits = torch.tensor([[100.0, 0.0, 0.0]])
    assert perplexity(float(token_nll(logits, torch.tensor([0])).sum()), 1) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        perplexity(0.0, 0)


# -- fidelity -----------------------------------------------------------------------------------------
def test_token_agreement_and_first_divergence():
    ref = [5, 6, 7, 8]
    assert token_agreement([5, 6, 7, 8], ref) == 1.0
    assert token_agreement([5, 0, 7, 0], ref) == 0.5
    assert token_agreement([5, 6], ref) == 0.5  # missing tokens disagree
    assert first_divergence([5, 6, 0, 8], ref) == 2
    assert first_divergence(ref, ref) == 4
    assert first_divergence([5, 6], ref) == 2  # a prefix diverges where it stops


def test_repeated_4gram_share_of_a_loop():
    # 4-grams of 1 2 3 4 1 2 3 4: 1234 2341 3412 4123 1234 -> one of five repeats an earlier one
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 / 5)
    assert repeated_ngram_share(list(range(20)), 4) == 0.0
    assert repeated_ngram_share([7] * 10, 4) == pytest.approx(6 / 7)  # 7 grams, 1 distinct
    assert repeated_ngram_share([1, 2, 3], 4) == 0.0


# -- passkey ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "key"),
    [(" 57540.", "57540"), ("The pass key is 71432. Remember", "71432"), ("12,345", "12345"), ("none", None)],
)
def test_parse_passkey(text, key):
    assert parse_passkey(text) == key


def test_passkey_correct_needs_the_first_number():
    assert passkey_correct(" 57540.", "57540")
    assert not passkey_correct(" 5754", "57540")
    assert not passkey_correct(" a type of passcode", "57540")


# -- attention reconstruction -------------------------------------------------------------------------
def _qkv(b=1, hq=4, hkv=2, n=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g),
            torch.randn(b, hkv, n, d, generator=g))


def test_attention_output_matches_a_naive_loop():
    q, k, v = _qkv(n=6)
    qpos = torch.arange(3, 6)
    out = attention_output(q[:, :, 3:], k, v, qpos, torch.arange(6).expand(1, 2, 6))
    for h in range(4):
        for i, p in enumerate(qpos.tolist()):
            logits = torch.stack([q[0, h, p] @ k[0, h // 2, j] / math.sqrt(8) for j in range(p + 1)])
            want = torch.softmax(logits, 0) @ v[0, h // 2, : p + 1]
            assert torch.allclose(out[0, h, i], want, atol=1e-5)


def test_reconstruction_error_is_zero_when_nothing_is_evicted():
    q, k, v = _qkv()
    everything = torch.arange(40).expand(1, 2, 40)
    assert reconstruction_error(q[:, :, -8:], k, v, everything) == pytest.approx(0.0, abs=1e-6)
    # a policy whose budget holds every slot keeps everything, so the error is zero too
    policy = load_policy("snapkv", budget=128, window=8, recent=8, interval=8)
    kept = kept_slots(policy, q, k, v)
    assert kept.shape[-1] == 40
    assert reconstruction_error(q[:, :, -8:], k, v, kept) == pytest.approx(0.0, abs=1e-6)


def test_reconstruction_error_grows_when_slots_are_evicted():
    q, k, v = _qkv()
    recent_only = torch.arange(32, 40).expand(1, 2, 8)
    err = reconstruction_error(q[:, :, -8:], k, v, recent_only)
    assert 0.0 < err < 2.0
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_reconstruction_metric_uses_the_policy_and_reports_layers():
    cfg = EvalConfig()
    metric = Reconstruction(cfg)
    metric._captured = [(*_qkv(seed=s), 8**-0.5) for s in range(3)]

    class Ctx:  # the metric only needs captured tensors here
        pass

    full = metric.run(Ctx(), None, None).values
    assert full["recon_error"] == pytest.approx(0.0, abs=1e-6)
    cfg.reconstruction.queries = 8
    out = metric.run(Ctx(), load_policy("streamingllm", budget=12), None).values
    assert len(out["recon_error_layers"]) == 3
    assert out["recon_error"] > 0


# -- exact chunk plans --------------------------------------------------------------------------------
def _token_by_token(schedule, held, seen, n):
    ends = []
    for i in range(n):
        held, seen = held + 1, seen + 1
        if schedule.fires(held, seen):
            ends.append(i + 1)
            held = schedule.budget
    return ends


@given(
    count=st.sampled_from(["slots", "tokens"]),
    budget=st.integers(2, 80),
    interval=st.integers(1, 40),
    held=st.integers(0, 200),
    padding=st.integers(0, 50),
)
def test_tokens_to_eviction_is_the_next_token_by_token_eviction(count, budget, interval, held, padding):
    """The harness ends a chunk where the cache says the next eviction falls: that is exactly
    where token-by-token decoding would evict next."""
    schedule = Schedule(budget=budget, recent=1, interval=interval, window=1, count=count)
    assert _token_by_token(schedule, held, held + padding, 4 * (budget + interval))[0] == \
        schedule.tokens_to_eviction(held, held + padding)


# -- configuration and registry -----------------------------------------------------------------------
def test_metric_registry_and_unknown_metric():
    assert set(METRICS) == {"perplexity", "fidelity", "passkey", "accuracy", "reconstruction", "speed", "lm"}
    with pytest.raises(EvalError, match="unknown metric"):
        get_metrics(["perplexity", "bleu"], EvalConfig())


def test_config_sets_and_validation():
    data = apply_sets({}, ["perplexity.tokens=1024", "budgets=[64, 128]", "passkey.context=[300,600]"])
    cfg = EvalConfig.build(data)
    assert cfg.perplexity.tokens == 1024 and cfg.budgets == [64, 128] and cfg.passkey.context == [300, 600]
    with pytest.raises(EvalError, match="perplexity.tokenz"):
        EvalConfig.build(apply_sets({}, ["perplexity.tokenz=3"]))
    with pytest.raises(EvalError, match="budgets"):
        EvalConfig.build({"budgets": [0]})
