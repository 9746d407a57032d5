"""The reasoning protocol's pure parts: pass@k, math-verify grading, loop signals, sampling, records."""

from __future__ import annotations

import importlib.util
import io
import json
from math import comb

import pytest
import torch

from kvpolicy.eval import reasoning as r
from kvpolicy.eval.progress import LineProgress, format_duration
from kvpolicy.eval.records import SampleStore, record_key
from kvpolicy.eval.sampling import SamplingParams, next_tokens, sample_key


# -- pass@k -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (4, 0, 1, 0.0),
        (4, 4, 1, 1.0),
        (4, 1, 1, 0.25),  # pass@1 is the share of correct samples
        (4, 2, 1, 0.5),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 3, 4, 13 / 14),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (8, 5, 4, 1.0),  # fewer than k wrong samples: some draw of k holds a correct one
        (16, 1, 8, 0.5),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, want):
    assert r.pass_at_k(n, c, k) == pytest.approx(want)
    assert r.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_mean_averages_over_problems_and_checks_its_input():
    correct = {"a": [True, False, False, False], "b": [True, True, False, False]}
    assert r.pass_at_k_mean(correct, 1) == pytest.approx((0.25 + 0.5) / 2)
    assert r.pass_at_k_mean(correct, 2) == pytest.approx((0.5 + 5 / 6) / 2)
    with pytest.raises(ValueError, match="between 1 and n"):
        r.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        r.pass_at_k(4, 5, 1)


# -- math-verify ---------------------------------------------------------------------------------
needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason="math-verify not installed (kvpolicy[bench])")


@pytest.mark.parametrize(
    ("response", "target"),
    [
        ("So the answer is 7.", "3 + 4 = 7\n#### 7"),  # GSM8K target: what follows ####
        ("They have 1,000 apples in all.", "#### 1,000"),
        ("The probability is \\boxed{0.5}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ("We get \\boxed{\\frac{\\sqrt 2}{2}}", "\\sqrt{2}/2"),
        ("Expanding, \\boxed{(x+1)^2}", "x^2+2x+1"),
        ("<think>maybe 5? no</think>\n\nThe answer is \\boxed{12}", "12"),
    ],
)
@needs_math_verify
def test_math_verify_accepts_equivalent_answers(response, target):
    assert r.math_equal(r.strip_thinking(response, "</think>"), target)


@pytest.mark.parametrize(
    ("response", "target"),
    [
        ("I think it is 31.", "#### 30"),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("\\boxed{x^2+1}", "(x+1)^2"),
        ("no number here", "42"),
        ("", "3"),
    ],
)
@needs_math_verify
def test_math_verify_rejects_different_answers(response, target):
    assert not r.math_equal(response, target)


def test_gold_answers_and_thinking():
    assert r.extract_gold("step one\n#### 1,234") == "$1234$"
    assert r.extract_gold("\\frac{1}{2}") == "$\\frac{1}{2}$"
    assert r.extract_gold("$5$") == "$5$"
    assert r.extract_gold(["\\boxed{3}"]) == "\\boxed{3}"
    assert r.strip_thinking("<think>a</think>\n  b", "</think>") == "b"
    assert r.strip_thinking("no marker", "</think>") == "no marker"
    assert r.strip_thinking("a</think>b", None) == "a</think>b"


# -- loops ---------------------------------------------------------------------------------------
def test_a_generation_ending_in_a_repeated_block_is_a_loop():
    block = [11, 12, 13, 14, 15, 16, 17]
    tokens = list(range(100, 140)) + block * 12  # 84 looping tokens after 40 distinct ones
    loop = r.find_loop(tokens)
    assert loop is not None and loop.period == 7 and loop.span == 84 and loop.repeats == 12
    # The smallest period wins (a block of 14 = two blocks of 7 also repeats).
    assert r.find_loop([5] * 80) == r.Loop(1, 80)


def test_loop_thresholds():
    block = list(range(30))
    assert r.find_loop(list(range(500, 600)) + block * 2) is None  # two copies are not three
    assert r.find_loop(list(range(500, 600)) + block * 3) == r.Loop(30, 90)
    assert r.find_loop([1, 2] * 20) is None  # 40 tokens: shorter than min_span 64
    assert r.find_loop([1, 2] * 20, min_span=32) == r.Loop(2, 40)
    assert r.find_loop(list(range(1000))) is None
    assert r.find_loop([]) is None
    # A loop that stops before the end is not the generation *ending* in a loop.
    assert r.find_loop([7] * 100 + list(range(10))) is None


def test_repeated_ngram_share_is_the_metrics_one():
    assert r.repeated_ngram_share([1, 2, 3, 4] * 5, 4) == pytest.approx(13 / 17)
    assert r.repeated_ngram_share(list(range(20)), 4) == 0.0


# -- sampling -------------------------------------------------------------------------------------
def test_sampling_is_per_row_seeded_and_respects_top_p_and_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    keys = torch.tensor([sample_key(0, "t", i) for i in range(3)])
    greedy = next_tokens(logits, SamplingParams(), keys, 0)
    assert torch.equal(greedy, logits.argmax(-1))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = next_tokens(logits, params, keys, 5)
    # A row's draw does not depend on the other rows, their order or the batch size.
    assert torch.equal(next_tokens(logits[[2, 0, 1]], params, keys[[2, 0, 1]], 5), a[[2, 0, 1]])
    assert int(next_tokens(logits[1:2], params, keys[1:2], 5)) == int(a[1])
    # top-k 1 and a tiny top-p are greedy.
    assert torch.equal(next_tokens(logits, SamplingParams(temperature=1.0, top_k=1), keys, 3), greedy)
    assert torch.equal(next_tokens(logits, SamplingParams(temperature=1.0, top_p=1e-6), keys, 3), greedy)
    # Over many steps, samples stay inside the top-p nucleus and follow the distribution.
    probs = torch.softmax(logits[0] / 0.8, -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) - probs[order] < 0.9).sum())].tolist())
    draws = [int(next_tokens(logits[:1], params, keys[:1], t)) for t in range(2000)]
    assert set(draws) <= nucleus
    top = int(order[0])
    share = draws.count(top) / len(draws)
    expect = float(probs[top] / probs[list(nucleus)].sum())
    assert abs(share - expect) < 0.05


def test_sampling_parameters_are_checked():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


# -- records and progress ------------------------------------------------------------------------
def _record(i: int) -> dict:
    return {"key": "snapkv@96", "task": "t", "doc_id": str(i), "sample": 0, "prompt_hash": "h", "response": f"r{i}"}


def test_sample_store_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    store = SampleStore(path)
    for i in range(3):
        store.add(_record(i))
    with path.open("a") as f:
        f.write(json.dumps(_record(3))[:25])  # killed mid-write
    again = SampleStore(path)
    assert len(again) == 3 and again.get(record_key(_record(2)))["response"] == "r2"
    again.add(_record(3))
    lines = path.read_text().splitlines()
    assert [json.loads(x)["doc_id"] for x in lines] == ["0", "1", "2", "3"]
    assert SampleStore(None).get(("a", "b", "c", 0, "d", "null")) is None


def test_progress_lines_have_rate_and_eta():
    out = io.StringIO()
    p = LineProgress("snapkv@96 gsm8k", 10, every=4, stream=out, done=2)
    for _ in range(8):
        p.update(1, tokens=100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # after 4 new samples, and after 8 (the last)
    assert lines[0].startswith("kvpolicy: snapkv@96 gsm8k: 6/10 samples")
    assert "tok/s" in lines[0] and "ETA" in lines[0]
    assert "10/10" in lines[-1] and "ETA" not in lines[-1]
    quiet = io.StringIO()
    silent = LineProgress("x", 2, every=-1, stream=quiet)
    silent.update(2)
    assert quiet.getvalue() == ""
    assert format_duration(5) == "5s" and format_duration(185) == "3m05s" and format_duration(3720) == "1h02m"
