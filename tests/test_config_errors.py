"""Bad policies fail at load with a PolicyError naming file, line and field; bad tensors fail early."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tensors

import kvpolicy
from kvpolicy import PolicyError

GOOD = """\
name: t
schedule:
  budget: 32
  recent: 8
  interval: 8
  window: 8
scorer: {type: attention}
reservations:
  - {type: sinks, n: 4}
selector: {type: greedy}
"""


def load_text(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return kvpolicy.load_policy(str(path))


def test_good_policy_loads(tmp_path):
    assert load_text(tmp_path, GOOD).budget == 32


def test_broken_yaml_names_file_and_line(tmp_path):
    bad = GOOD.replace("  recent: 8", "  recent: [8")
    with pytest.raises(PolicyError) as err:
        load_text(tmp_path, bad, "broken.yaml")
    msg = str(err.value)
    assert "broken.yaml" in msg and "line" in msg and "YAML" in msg


def test_invalid_field_names_line_and_field(tmp_path):
    with pytest.raises(PolicyError) as err:
        load_text(tmp_path, GOOD.replace("budget: 32", "budget: lots"), "field.yaml")
    msg = str(err.value)
    assert "field.yaml" in msg and "line 3" in msg and "schedule.budget" in msg


def test_unknown_stage_lists_registered(tmp_path):
    with pytest.raises(PolicyError) as err:
        load_text(tmp_path, GOOD.replace("type: attention", "type: atention"))
    msg = str(err.value)
    assert "atention" in msg and "attention" in msg and "redundancy" in msg and "line 7" in msg


def test_unknown_stage_parameter(tmp_path):
    with pytest.raises(PolicyError, match="kernal"):
        load_text(tmp_path, GOOD.replace("{type: attention}", "{type: attention, kernal: 5}"))


@pytest.mark.parametrize(
    "old,new,pattern",
    [
        ("budget: 32", "budget: 8", "recent"),  # budget <= recent
        ("budget: 32", "budget: 7", "recent"),
        ("n: 4", "n: 30", "more slots than the budget"),  # sinks + recent > budget
        ("window: 8", "window: 100", "window"),  # window larger than the buffer
        ("budget: 32", "budget: -1", "budget"),
        ("recent: 8", "recent: -1", "recent"),
        ("interval: 8", "interval: 0", "interval"),
        ("window: 8", "window: -2", "window"),
        ("n: 4", "n: -1", "n"),
        ("{type: attention}", "{type: attention, kernel: 4}", "odd"),
        ("{type: attention}", "{type: attention, pooling: median}", "pooling"),
    ],
)
def test_bad_schedule_or_sizes_fail_at_load(tmp_path, old, new, pattern):
    with pytest.raises(PolicyError, match=pattern):
        load_text(tmp_path, GOOD.replace(old, new))


def test_too_many_reserved_slots():
    cfg = {
        "name": "t", "schedule": {"budget": 32, "recent": 8, "interval": 8, "window": 8},
        "scorer": {"type": "attention"},
        "reservations": [{"type": "sinks", "n": 4},
                         {"type": "top_scores", "n": 21, "scorer": {"type": "value_magnitude"}}],
        "selector": {"type": "greedy"},
    }
    with pytest.raises(PolicyError, match="more slots than the budget"):
        kvpolicy.load_policy(cfg)
    cfg["reservations"][1]["n"] = 1.5  # fraction of the budget above 1
    with pytest.raises(PolicyError, match="fraction"):
        kvpolicy.load_policy(cfg)
    cfg["reservations"][1]["n"] = -2
    with pytest.raises(PolicyError, match="negative"):
        kvpolicy.load_policy(cfg)


def test_stochastic_selector_rejects_signed_scores():
    with pytest.raises(PolicyError, match="non-negative"):
        kvpolicy.load_policy("rkv", budget=64).config.model_copy()  # fine on its own
        kvpolicy.load_policy({
            "name": "t", "schedule": {"budget": 32, "recent": 8, "interval": 8, "window": 8},
            "scorer": {"type": "key_norm"}, "selector": {"type": "stochastic"},
        })


def test_overrides():
    p = kvpolicy.load_policy("vase-attnv", budget=512)
    assert p.budget == 512
    with pytest.raises(PolicyError, match="unknown override 'bugdet'"):
        kvpolicy.load_policy("vase-attnv", bugdet=512)
    with pytest.raises(PolicyError, match="recent"):
        kvpolicy.load_policy("vase-attnv", budget=32)  # recent 64 >= budget
    # the relative StreamingLLM window follows an overridden budget
    s = kvpolicy.load_policy("streamingllm", budget=100)
    assert s.schedule.recent == 96
    assert kvpolicy.load_policy(s, budget=200).schedule.recent == 196


def test_unknown_policy_name_lists_registered():
    with pytest.raises(PolicyError) as err:
        kvpolicy.load_policy("vase-atnv")
    assert "vase-attnv" in str(err.value) and "snapkv" in str(err.value)


# -- tensors --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    return kvpolicy.load_policy("snapkv", budget=32, recent=8, window=8, interval=8)


def test_wrong_rank(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match=r"keys must be 4-D, got shape \(2, 2, 40\)"):
        policy.select(k[..., 0], v, q)


def test_values_must_match_keys(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match=r"values \(2, 2, 39, 8\).*keys \(2, 2, 40, 8\)"):
        policy.select(k, v[:, :, :39], q)


def test_query_head_dim_and_batch(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match=r"queries \(2, 4, 4, 7\)"):
        policy.select(k, v, q[..., :7])
    with pytest.raises(ValueError, match=r"queries \(1, 4, 4, 8\)"):
        policy.select(k, v, q[:1])


def test_query_heads_multiple_of_kv_heads(policy):
    k, v, q = make_tensors(hkv=2, hq=3, n=40)
    with pytest.raises(ValueError, match=r"multiple of KV heads.*\(2, 3, 4, 8\).*\(2, 2, 40, 8\)"):
        policy.select(k, v, q)


def test_mask_shapes(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match=r"slot_valid must have shape .*got \(2, 39\)"):
        policy.select(k, v, q, slot_valid=torch.ones(2, 39, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query_valid must have shape .*got \(2, 5\)"):
        policy.select(k, v, q, query_valid=torch.ones(2, 5, dtype=torch.bool))


def test_integer_tensors_rejected(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(TypeError, match="float"):
        policy.select(k.long(), v, q)


def test_mismatched_devices(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match="one device.*meta"):
        policy.select(k, v, q.to("meta"))
