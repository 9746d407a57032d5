"""Bad policies fail at load with a PolicyError naming file, line and field; bad tensors fail early."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from helpers import make_tensors

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
        # a boolean for a number: pydantic's lax mode would read it as 1 or 0 (interval 1)
        ("interval: 8", "interval: true", "interval must be a number, got true"),
        ("budget: 32", "budget: false", "budget must be a number, got false"),
        ("n: 4", "n: true", "n must be a number, got true"),
        ("{type: attention}", "{type: attention, kernel: true}", "kernel must be a number"),
    ],
)
def test_bad_schedule_or_sizes_fail_at_load(tmp_path, old, new, pattern):
    with pytest.raises(PolicyError, match=pattern):
        load_text(tmp_path, GOOD.replace(old, new))


@pytest.mark.parametrize(("old", "new", "pattern"), [
    ("budget: 32", "budget: '16'", r"line 3: schedule\.budget: budget must be a number, got the string '16'"),
    ("interval: 8", "interval: '8'", r"line 5: schedule\.interval: interval must be a number"),
    ("{type: attention}", "{type: attention, kernel: '5.0'}", r"line 7: scorer\.kernel: kernel must be a number"),
    ("{type: attention}", "{type: key_norm, low_norm_first: 'true'}",
     r"line 7: scorer\.low_norm_first: low_norm_first must be true or false, got the string 'true'"),
    ("{type: attention}", "{type: combination, terms: [{weight: '0.5', scorer: key_norm}]}",
     r"scorer\.terms\.0\.weight: weight must be a number"),
    ("{type: attention}", "{type: combination, terms: [{weight: true, scorer: key_norm}]}",
     r"scorer\.terms\.0\.weight: weight must be a number, got true"),
    ("n: 4", "n: '4'", r"line 9: reservations\.0\.n: n must be a number"),
    ("name: t", "name: t\nseed: '3'", r"line 2: seed: seed must be a number"),
])
def test_quoted_numbers_and_bools_are_refused_as_booleans_are(tmp_path, old, new, pattern):
    """Strict, as pydantic's strict mode: a quoted '16' is a string, not the number 16 (a bool was
    refused for a number already, and recent: ' 4 ' too), named at the field's line."""
    with pytest.raises(PolicyError, match=pattern):
        load_text(tmp_path, GOOD.replace(old, new))


def test_the_strings_the_schedule_reads_and_parsed_overrides_still_load(tmp_path):
    assert load_text(tmp_path, GOOD.replace("recent: 8", "recent: budget - 4")).schedule.recent == 28
    assert kvpolicy.load_policy("dms").schedule.evict_above == kvpolicy.load_policy("dms").schedule.recent
    assert kvpolicy.load_policy("snapkv", budget=128, compress_prompt=True).budget == 128
    with pytest.raises(PolicyError, match='recent must be an int or "budget - N"'):
        load_text(tmp_path, GOOD.replace("recent: 8", "recent: ' 4 '"))


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
    for field in ("interval", "seed", "window"):  # as overrides too, where EvictingCache(seed=True) refused already
        with pytest.raises(PolicyError, match=f"{field} must be a number, got true"):
            kvpolicy.load_policy("vase-attnv", **{field: True})
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


@pytest.mark.parametrize("field", ["layer_idx", "evictions", "streams"])
@pytest.mark.parametrize("value", [1.5, 2.0, True, None, "a", [0, 1], torch.tensor([0.0, 1.0]), torch.tensor([True, False])],
                         ids=["float", "whole-float", "bool", "none", "str", "list", "float-tensor", "bool-tensor"])
def test_per_row_ints_refuse_what_is_not_an_int(policy, field, value):
    """A float would be truncated (layer 1.5 read as 1), a list or a bool read as ints: each is
    refused by name, as errors.md promises, instead of a silently different draw or layer."""
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match=rf"{field} must be an int or a \[B=2\] integer tensor"):
        policy.select(k, v, q, **{field: value})
    policy.select(k, v, q, **{field: 1})
    policy.select(k, v, q, **{field: torch.tensor([0, 1])})


def test_integer_tensors_rejected(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(TypeError, match="float"):
        policy.select(k.long(), v, q)


def test_mismatched_devices(policy):
    k, v, q = make_tensors(n=40)
    with pytest.raises(ValueError, match="one device.*meta"):
        policy.select(k, v, q.to("meta"))


# -- documents that used to escape as other exceptions, or to load when they should not ----------
TRIVIAL = """\
name: t
schedule: {budget: 32, recent: 8, interval: 8, window: 8}
scorer: {type: attention}
selector: {type: greedy}
"""


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.replace("name: t", "name: caf\xe9").encode("latin-1"))
    with pytest.raises(PolicyError) as err:
        kvpolicy.load_policy(path)
    assert err.value.source == str(path)
    assert "latin1.yaml" in str(err.value) and "UTF-8" in str(err.value) and "line 1" in str(err.value)


def test_recursive_alias_is_refused(tmp_path):
    with pytest.raises(PolicyError, match=r"line 1, column 4: .*anchors and aliases are not allowed"):
        load_text(tmp_path, "a: &a [*a]\n")


def test_anchors_and_aliases_are_refused_with_their_line(tmp_path):
    text = GOOD.replace("  recent: 8", "  recent: &r 8").replace("  window: 8", "  window: *r")
    with pytest.raises(PolicyError, match=r"line 4, column 11: .*anchor &r"):
        load_text(tmp_path, text)


def test_deep_nesting_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="nested more than 64 levels"):
        load_text(tmp_path, GOOD + "description: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(PolicyError, match="nested more than 64 levels"):
        load_text(tmp_path, GOOD + "description: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")


def test_deeply_nested_mapping_is_a_policy_error():
    deep: object = "random"
    for _ in range(2000):
        deep = {"type": "combination", "terms": [{"weight": 1.0, "scorer": deep}]}
    with pytest.raises(PolicyError):
        kvpolicy.load_policy({"name": "t", "schedule": {"budget": 32, "recent": 8}, "scorer": deep, "selector": "greedy"})


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_alias_bomb_is_refused_at_its_first_anchor(tmp_path):
    for text in (BOMB, "".join(BOMB.splitlines(keepends=True)[:5])):  # the small one ends on old code too
        with pytest.raises(PolicyError, match=r"line 1, column 4: .*anchor &a: anchors and aliases"):
            load_text(tmp_path, text)


def test_line_index_visits_shared_nodes_once():
    # The line index of an alias bomb (9**9 leaves once expanded) takes one pass over its nodes.
    from kvpolicy.documents import _index_lines

    node = yaml.compose(BOMB, Loader=yaml.SafeLoader)
    lines: dict[tuple, int] = {}
    _index_lines(node, lines)
    assert len(lines) < 200
    assert lines[("i",)] == 9 and lines[("a", 0)] == 1


def test_integer_over_the_digit_limit(tmp_path):
    with pytest.raises(PolicyError, match=r"line 1, column 7: .*integer of more than 4300 digits"):
        load_text(tmp_path, "seed: " + "9" * 5000 + "\n" + GOOD)


@pytest.mark.parametrize("seed", [2**64, 2**63, -1])
def test_seed_out_of_int64_range(tmp_path, seed):
    with pytest.raises(PolicyError, match=r"line 1: seed: Input should be"):
        load_text(tmp_path, f"seed: {seed}\n" + GOOD)
    with pytest.raises(PolicyError, match="seed"):
        kvpolicy.load_policy("snapkv", seed=seed)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, None])
def test_seed_bounds_are_inclusive(tmp_path, seed):
    assert kvpolicy.load_policy("snapkv", seed=seed).config.seed == seed


@pytest.mark.parametrize(
    "stage,pattern",
    [
        ("{type: attention, kernel: 2147483649}", r"line 3: scorer.kernel: .*less than or equal to 1023"),
        ("{type: attention, tile_elements: 17179869184}", r"line 3: scorer.tile_elements: .*less than or equal"),
        ("{type: redundancy, chunk_elements: 17179869184}", r"scorer.chunk_elements: .*less than or equal"),
        ("{type: leverage, rank: 100000}", r"scorer.rank: .*less than or equal to 4096"),
        ("{type: leverage, local_window: 17179869184}", r"scorer.local_window: .*less than or equal"),
    ],
)
def test_stage_integers_are_bounded(tmp_path, stage, pattern):
    with pytest.raises(PolicyError, match=pattern):
        load_text(tmp_path, TRIVIAL.replace("{type: attention}", stage))


@pytest.mark.parametrize("field", ["budget", "recent", "interval", "window"])
def test_schedule_integers_are_bounded(field):
    with pytest.raises(PolicyError, match=rf"schedule.{field}: .*less than or equal to 16777216"):
        kvpolicy.load_policy("snapkv", **{field: 2**40})


def test_reservation_counts_are_bounded():
    cfg = {"name": "t", "schedule": {"budget": 32, "recent": 8}, "scorer": "random", "selector": "greedy"}
    with pytest.raises(PolicyError, match=r"reservations.0.n: .*less than or equal"):
        kvpolicy.load_policy({**cfg, "reservations": [{"type": "sinks", "n": 2**40}]})
    top = {"type": "top_scores", "scorer": "random", "n": 2**40}
    with pytest.raises(PolicyError, match=r"reservations.0.n"):
        kvpolicy.load_policy({**cfg, "reservations": [top]})


def test_a_problem_an_override_makes_is_blamed_on_it_not_on_the_files_line():
    """snapkv.yaml's line 8 says budget: 1024; the 8 is the override's."""
    with pytest.raises(PolicyError) as caught:
        kvpolicy.load_policy("snapkv", budget=8)
    assert caught.value.problems == [
        "override budget=8: schedule: budget (8) must be above the recent buffer (64): otherwise no slot is ever a "
        "candidate"
    ]
    with pytest.raises(PolicyError, match=r"override budget=True: schedule\.budget: budget must be a number"):
        kvpolicy.load_policy("snapkv").with_overrides(budget=True)
    # a problem of the document itself keeps its line, beside the override's
    bad = "name: p\nschedule: {budget: 64, recent: 8}\nscorer: {type: attention, kernel: 4}\nselector: greedy\n"
    with pytest.raises(PolicyError) as caught:
        kvpolicy.load_policy(bad, recent=64)
    assert any(p.startswith("line 3: scorer") for p in caught.value.problems), caught.value.problems
    assert not any(p.startswith("line") and "recent" in p for p in caught.value.problems), caught.value.problems


def test_overrides_on_a_schedule_that_is_not_a_mapping():
    with pytest.raises(PolicyError, match="schedule is not a mapping"):
        kvpolicy.load_policy({"name": "t", "schedule": 5, "selector": "greedy"}, budget=64)
    with pytest.raises(PolicyError, match="schedule"):  # no schedule override: pydantic reports it
        kvpolicy.load_policy({"name": "t", "schedule": 5, "selector": "greedy"}, seed=1)


@pytest.mark.parametrize("source", [3, None, 1.5, ["snapkv"], object()])
def test_load_policy_of_a_wrong_kind_is_a_type_error(source):
    with pytest.raises(TypeError, match="registered policy name, a path, YAML text"):
        kvpolicy.load_policy(source)


def test_load_policy_reads_bytes_as_utf8_yaml():
    assert kvpolicy.load_policy(GOOD.encode()).budget == 32
    with pytest.raises(PolicyError, match="UTF-8"):
        kvpolicy.load_policy(GOOD.replace("name: t", "name: caf\xe9").encode("latin-1"))


def test_string_sources_follow_documented_rules(tmp_path, monkeypatch):
    # YAML text without a newline (or a dot) is YAML text, not a policy name.
    one_line = "{name: t, schedule: {budget: 32, recent: 8}, scorer: attention, selector: greedy}"
    assert kvpolicy.load_policy(one_line).budget == 32
    with pytest.raises(PolicyError, match="schedule: Field required"):
        kvpolicy.load_policy("budget: 3")
    with pytest.raises(PolicyError, match="no such policy file: missing.yaml"):
        kvpolicy.load_policy("missing.yaml")
    with pytest.raises(PolicyError, match="no such policy file"):
        kvpolicy.load_policy("some/dir/policy")
    with pytest.raises(PolicyError, match="unknown policy 'nope'; registered policies: .*snapkv"):
        kvpolicy.load_policy("nope")
    # An existing file wins over the other readings, whatever its name.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").write_text(GOOD)
    assert kvpolicy.load_policy("mine").budget == 32


@pytest.mark.parametrize("weight", [float("inf"), float("-inf"), float("nan")])
def test_combination_weights_must_be_finite(weight):
    cfg = {
        "name": "t", "schedule": {"budget": 32, "recent": 8},
        "scorer": {"type": "combination", "terms": [{"weight": weight, "scorer": "random"}]},
        "selector": "greedy",
    }
    with pytest.raises(PolicyError, match=r"scorer.terms.0.weight: Input should be a finite number"):
        kvpolicy.load_policy(cfg)


def test_weights_written_inf_or_nan_in_yaml(tmp_path):
    text = TRIVIAL.replace(
        "scorer: {type: attention}", "scorer:\n  type: combination\n  terms:\n    - {weight: .nan, scorer: random}"
    )
    with pytest.raises(PolicyError, match=r"line 6: scorer.terms.0.weight"):
        load_text(tmp_path, text)


@pytest.mark.parametrize(
    "selector,reservation",
    [
        ({"type": "stochastic", "temperature": float("inf")}, None),
        ({"type": "stochastic", "temperature": float("nan")}, None),
        ("greedy", {"type": "top_scores", "scorer": "random", "n": float("nan")}),
        ("greedy", {"type": "top_scores", "scorer": "random", "n": float("inf")}),
    ],
)
def test_no_inf_or_nan_in_other_float_fields(selector, reservation):
    cfg = {"name": "t", "schedule": {"budget": 32, "recent": 8}, "scorer": "random", "selector": selector}
    if reservation is not None:
        cfg["reservations"] = [reservation]
    with pytest.raises(PolicyError):
        kvpolicy.load_policy(cfg)


@pytest.mark.parametrize("threshold", [float("nan"), float("inf")])
def test_redundancy_threshold_must_be_finite(threshold):
    cfg = {"name": "t", "schedule": {"budget": 32, "recent": 8}, "selector": "greedy"}
    cfg["scorer"] = {"type": "redundancy", "threshold": threshold}
    with pytest.raises(PolicyError, match="scorer.threshold"):
        kvpolicy.load_policy(cfg)


def test_duplicate_keys_are_refused_with_key_and_line(tmp_path):
    with pytest.raises(PolicyError, match=r"line 4, column 3: .*duplicate key 'budget' \(first at line 3\)"):
        load_text(tmp_path, GOOD.replace("  recent: 8", "  budget: 64"))
    with pytest.raises(PolicyError, match=r"duplicate key 'name'"):
        load_text(tmp_path, GOOD + "name: again\n")


@pytest.mark.parametrize(
    "stages,reader",
    [
        ({"scorer": "current_attention"}, "scorer 'current_attention'"),
        ({"scorer": {"type": "quest", "page_size": 4}}, "scorer 'quest'"),
        ({"scorer": "attention"}, "scorer 'attention'"),
        ({"scorer": {"type": "combination", "terms": [{"weight": 1.0, "scorer": "key_norm"},
                                                      {"weight": 0.5, "scorer": "current_attention"}]}},
         "scorer 'combination'"),
        ({"scorer": "key_norm", "reservations": [{"type": "top_scores", "n": 2, "scorer": "current_attention"}]},
         "reservations[0] 'top_scores'"),
    ],
)
def test_a_stage_reading_the_queries_needs_a_window(stages, reader):
    """Stages that read the query window (the newest query: current_attention, quest; the whole
    window: attention), however deeply nested, refuse ``window: 0`` at load, naming the field."""
    cfg = {"name": "t", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 0}, "selector": "greedy",
           **stages}
    with pytest.raises(PolicyError, match=re.escape(f"schedule.window is 0, but {reader} reads the window's queries")):
        kvpolicy.load_policy(cfg)
    assert kvpolicy.load_policy({**cfg, "schedule": {**cfg["schedule"], "window": 1}}).schedule.window == 1
    # Stages that read no query run with no window.
    assert kvpolicy.load_policy({**cfg, "scorer": "key_norm", "reservations": []}).schedule.window == 0
