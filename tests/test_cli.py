"""The kvpolicy command and the policy-file JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from typing import ClassVar

import pytest
import torch
import yaml
from helpers import Contract2Plugin, file_size_limit

import kvpolicy
from kvpolicy.cli import NEEDS, POLICY_MODES, first_clause, locate_problem, main, parse_overrides
from kvpolicy.config import SUMMARY_MAX
from kvpolicy.documents import PolicyError
from kvpolicy.registry import get_registry, reset_registry
from kvpolicy.schema import UNION_DEFS, first_sentence, policy_json_schema
from kvpolicy.stages import Selector

BUILTIN_POLICIES = [
    "cake",
    "chunkkv",
    "criticalkv",
    "curdkv",
    "duo-attention",
    "evict-large-range",
    "expected-attention",
    "gkv",
    "h2o",
    "knorm",
    "lagkv",
    "oracle-topk",
    "quest",
    "random",
    "rkv",
    "snapkv",
    "snapkv-paper",
    "streamingllm",
    "tova",
    "triattention",
    "vase-attnv",
    "vase-dkv",
]


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that no summary is cut
    reset_registry()
    yield
    reset_registry()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- policies -----------------------------------------------------------------------------------
def _policy_rows(out: str) -> dict[str, list[str]]:
    """The policies list's rows by name (``name source mode budget summary...``)."""
    table = out.split("\nScorers")[0].strip("\n").splitlines()[3:]  # title, header, rule; "random" is also a scorer
    return {line.split()[0]: line.split(maxsplit=4) for line in table if line.strip()}


def _config_stages(config) -> list:
    """Every stage of a policy config, nested ones included, read from the config itself."""
    tops = [config.scorer, *config.reservations, config.selector, config.allocation, config.merge]
    return [s for top in tops if top is not None for s in top.walk()]


#: What each ``--needs`` value means, from the stages' own declarations (not from the command).
NEEDED = {
    "model-facts": lambda config: any(s.needs_model for s in _config_stages(config)),
    "state": lambda config: any(s.state_fields for s in _config_stages(config)),
    "calibration": lambda config: any(s.data_files for s in _config_stages(config)),
}


def test_policies_lists_builtins_with_their_plugin(capsys):
    code, out, _ = run(capsys, "policies")
    assert code == 0
    rows = _policy_rows(out)
    for name in BUILTIN_POLICIES:
        assert name in rows, name
        policy = kvpolicy.load_policy(name)
        assert rows[name][1:4] == ["kvpolicy", policy.mode, str(policy.budget)]
        assert rows[name][4] == (policy.config.summary or first_clause(policy.config.description))
    for title in ("Policies", "Scorers", "Reservations", "Selectors"):
        assert title in out


class LongWinded(Contract2Plugin):
    """A plugin policy with a long name and a long description, no summary."""

    DESCRIPTION = ("Long-winded: keeps what a very long explanation says it keeps, " * 6).strip()

    @kvpolicy.hookimpl
    def kvpolicy_policies(self):
        return {"a-policy-with-a-rather-long-name": {
            "name": "a-policy-with-a-rather-long-name", "description": self.DESCRIPTION,
            "schedule": {"budget": 64, "recent": 8}, "scorer": "random", "selector": "greedy"}}


def test_policies_is_a_line_a_policy_within_80_columns(capsys, monkeypatch):
    """31 policies used to take 437 lines at 80 columns (each description wrapped, names lost)."""
    from rich.cells import cell_len

    monkeypatch.setenv("COLUMNS", "80")  # the width rich's Console and shutil both read
    get_registry().register_plugin(LongWinded(), name="long-winded-plugin")
    code, out, _ = run(capsys, "policies")
    assert code == 0
    assert max(cell_len(line) for line in out.splitlines()) <= 80  # the stage lists too
    table = out.split("\nScorers")[0].strip("\n").splitlines()
    names = get_registry().policies
    assert len(table) == 3 + len(names)  # title, header, rule, then a line each
    rows = _policy_rows(out)
    assert sorted(rows) == sorted(names)  # every name whole
    long_name = "a-policy-with-a-rather-long-name"
    assert rows[long_name][1] == "long-winded-plugin"
    cut = rows[long_name][4]
    assert cut.endswith("…") and first_clause(LongWinded.DESCRIPTION).startswith(cut[:-1])
    for name in names:  # a summary shorter than its room is shown whole
        config = kvpolicy.load_policy(name).config
        assert rows[name][4] == config.summary or rows[name][4].endswith("…") or name == long_name
    code, shown, _ = run(capsys, "show", long_name)
    assert code == 0 and yaml.safe_load(shown)["description"] == LongWinded.DESCRIPTION  # the whole text


def test_summary_field_is_optional_one_line_and_short(tmp_path):
    base = {"name": "p", "description": "Words.", "schedule": {"budget": 16, "recent": 4}, "scorer": "random",
            "selector": "greedy"}
    plain = kvpolicy.load_policy(base)
    assert plain.config.summary == "" and "summary" not in plain.config.to_dict()  # files without it keep their form
    summed = kvpolicy.load_policy({**base, "summary": "a few words"})
    assert summed.config.to_dict()["summary"] == "a few words"
    assert kvpolicy.load_policy(summed.to_yaml()).config == summed.config
    with pytest.raises(PolicyError, match=rf"summary: String should have at most {SUMMARY_MAX}"):
        kvpolicy.load_policy({**base, "summary": "x" * (SUMMARY_MAX + 1)})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**base, "summary": "two\nlines"}))
    with pytest.raises(PolicyError, match=r"line \d+: summary: one line only"):
        kvpolicy.load_policy(tmp_path / "p.yaml")
    assert "summary" in policy_json_schema()["properties"]


def test_first_clause():
    assert first_clause("H2O (Heavy-Hitter Oracle): keep the heavy hitters; and more. Next.") == "keep the heavy hitters"
    assert first_clause("Scores (mean: over the window; then pooled) by attention. More.") == \
        "Scores (mean: over the window; then pooled) by attention."
    assert first_clause("A heading that runs on for well over forty characters: the rest") == \
        "A heading that runs on for well over forty characters: the rest"
    assert first_clause(None) == "" and first_clause("Only: ") == "Only:"


def _filter_cases() -> list:
    cases = [(["--mode", mode], lambda config, plugin, mode=mode: config.mode == mode) for mode in POLICY_MODES]
    cases += [(["--needs", need], lambda config, plugin, need=need: NEEDED[need](config)) for need in NEEDS]
    cases += [
        (["--source", "kvpolicy"], lambda config, plugin: plugin == "kvpolicy"),
        (["--source", "builtin"], lambda config, plugin: plugin == "kvpolicy"),
        (["--source", "builtin", "--mode", "select"], lambda config, plugin: plugin == "kvpolicy" and config.mode == "select"),
        (["--needs", "state", "--mode", "evict"], lambda config, plugin: NEEDED["state"](config) and config.mode == "evict"),
    ]
    return cases


def test_needs_filters_are_the_ones_tested():
    assert set(NEEDS) == set(NEEDED)
    assert set(POLICY_MODES) == {"evict", "select"}  # a new mode: give it a policy and a case here


@pytest.mark.parametrize("flags,keep", _filter_cases(), ids=lambda c: " ".join(c) if isinstance(c, list) else "")
def test_policies_filters_by_source_mode_and_needs(capsys, flags, keep):
    registry = get_registry()
    want = sorted(n for n, r in registry.policies.items() if keep(kvpolicy.load_policy(n).config, r.plugin))
    assert want and len(want) < len(registry.policies)  # the filter selects something, not everything
    code, out, _ = run(capsys, "policies", *flags)
    assert code == 0
    assert sorted(_policy_rows(out)) == want
    assert "Scorers" not in out  # a filtered list is of policies only
    code, out, _ = run(capsys, "policies", "--json", *flags)
    assert code == 0
    entries = json.loads(out)
    assert [e["name"] for e in entries] == want
    for entry in entries:
        config = kvpolicy.load_policy(entry["name"]).config
        assert entry["description"] == config.description and entry["mode"] == config.mode
        assert entry["budget"] == config.schedule.budget
        assert entry["needs"] == [need for need in NEEDS if NEEDED[need](config)]


def test_policies_refuses_an_unknown_filter_naming_the_valid_ones(capsys):
    code, _, err = run(capsys, "policies", "--source", "no-such-plugin")
    assert code == 2
    for source in ["builtin", *{r.plugin for r in get_registry().policies.values()}]:
        assert source in err
    for flag, valid in (("--mode", POLICY_MODES), ("--needs", tuple(NEEDS))):
        with pytest.raises(SystemExit) as exc:
            run(capsys, "policies", flag, "no-such-value")
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "no-such-value" in err and all(v in err for v in valid)


def test_policies_says_an_invalid_policy_is_left_out_of_a_filtered_list(capsys):
    class Broken(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"broken-one": {"name": "broken-one", "schedule": {"budget": 0}, "selector": "greedy"}}

    get_registry().register_plugin(Broken(), name="broken-plugin")
    code, out, err = run(capsys, "policies", "--mode", "evict")
    assert code == 0 and "broken-one" not in out
    assert "broken-one" in err and "invalid" in err


def test_policies_lists_every_stage(capsys):
    code, out, _ = run(capsys, "policies")
    assert code == 0
    registry = get_registry()
    for table in registry.stages.values():
        for type_name, registered in table.items():
            line = next(ln for ln in out.splitlines() if ln.startswith(f"{type_name} "))
            assert registered.plugin in line


def test_policies_marks_an_invalid_policy_without_failing(capsys):
    class Broken(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"broken-one": {"name": "broken-one", "schedule": {"budget": 0}, "selector": "greedy"}}

    get_registry().register_plugin(Broken(), name="broken-plugin")
    code, out, _ = run(capsys, "policies")
    assert code == 0
    line = next(ln for ln in out.splitlines() if "broken-one" in ln)
    assert "broken-plugin" in line and "invalid" in line


# -- show ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUILTIN_POLICIES)
def test_show_round_trips_through_load_policy(capsys, name):
    code, out, _ = run(capsys, "show", name, "--budget", "512")
    assert code == 0
    shown = kvpolicy.load_policy(yaml.safe_load(out))
    expected = kvpolicy.load_policy(name, budget=512)
    assert shown.config == expected.config
    assert shown.to_yaml() == out


def test_show_applies_set_overrides(capsys):
    code, out, _ = run(
        capsys, "show", "streamingllm", "--budget", "256", "--set", "recent=budget - 4", "--set", "seed=7"
    )
    assert code == 0
    data = yaml.safe_load(out)
    assert data["schedule"]["budget"] == 256
    assert data["schedule"]["recent"] == 252
    assert data["seed"] == 7


def test_show_reads_a_file(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(kvpolicy.load_policy("snapkv").to_yaml().replace("name: snapkv", "name: mine"))
    code, out, _ = run(capsys, "show", str(path))
    assert code == 0
    assert yaml.safe_load(out)["name"] == "mine"


def test_show_unknown_name_is_a_clean_error(capsys):
    code, out, err = run(capsys, "show", "no-such-policy")
    assert code == 2
    assert out == ""
    assert "unknown policy 'no-such-policy'" in err and "snapkv" in err
    assert "Traceback" not in err


def test_show_bad_override_is_a_clean_error(capsys):
    code, _, err = run(capsys, "show", "snapkv", "--set", "nonsense=1")
    assert code == 2
    assert "unknown override 'nonsense'" in err
    code, _, err = run(capsys, "show", "snapkv", "--set", "budget")
    assert code == 2
    assert "KEY=VALUE" in err


def test_show_override_breaking_the_policy_names_the_field(capsys):
    code, _, err = run(capsys, "show", "vase-attnv", "--budget", "32")
    assert code == 2
    assert "override budget=32: schedule: budget (32)" in err  # not the file's line, which says 1024
    assert "Traceback" not in err
    code, out, _ = run(capsys, "show", "snapkv", "--set", "budget=128", "--set", "compress_prompt=true")
    assert code == 0 and "budget: 128" in out  # --set values arrive parsed, not as strings
    code, _, err = run(capsys, "show", "snapkv", "--set", "budget=true")
    assert code == 2 and "override budget=True: schedule.budget: budget must be a number" in err


# -- validate -----------------------------------------------------------------------------------
BROKEN = """\
name: broken
schedule:
  budget: -5
  recent: 4
scorer: {type: attention, kernel: 4}
selector: {type: greedy}
"""


def test_validate_good_files(capsys):
    files = [
        str(p) for p in sorted((kvpolicy.__path__[0] + "/policies/" + n + ".yaml") for n in BUILTIN_POLICIES)
    ]
    code, out, _ = run(capsys, "validate", *files)
    assert code == 0
    assert out.count(": OK") == len(files)


def test_validate_reports_file_line_and_field(capsys, tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text(BROKEN)
    good = tmp_path / "good.yaml"
    good.write_text(kvpolicy.load_policy("rkv").to_yaml())
    code, out, err = run(capsys, "validate", str(good), str(bad))
    assert code == 1
    assert f"{good}: OK" in out
    assert f"{bad}:3: schedule.budget:" in out
    assert "1 of 2" in err


def test_validate_reports_a_stage_error_at_its_line(capsys, tmp_path):
    bad = tmp_path / "stage.yaml"
    bad.write_text(BROKEN.replace("budget: -5", "budget: 64"))
    code, out, _ = run(capsys, "validate", str(bad))
    assert code == 1
    assert f"{bad}:5: scorer" in out and "kernel must be odd" in out


def test_validate_reports_yaml_syntax_errors_and_missing_files(capsys, tmp_path):
    bad = tmp_path / "syntax.yaml"
    bad.write_text("name: x\nschedule: {budget: 4\n")
    code, out, _ = run(capsys, "validate", str(bad), str(tmp_path / "missing.yaml"))
    assert code == 1
    assert f"{bad}:" in out and "not valid YAML" in out
    assert "missing.yaml: no such policy file" in out
    code, out, err = run(capsys, "validate", str(tmp_path))  # it exists: said so, not "no such file"
    assert code != 0 and f"{tmp_path} is a directory, not a policy file" in out + err


# -- schema -------------------------------------------------------------------------------------
def test_schema_command_prints_json(capsys, tmp_path):
    code, out, _ = run(capsys, "schema")
    assert code == 0
    assert json.loads(out) == policy_json_schema()
    target = tmp_path / "policy.schema.json"
    code, _, _ = run(capsys, "schema", "--output", str(target))
    assert code == 0
    assert json.loads(target.read_text()) == policy_json_schema()


def test_schema_output_is_replaced_whole_or_not_at_all(capsys, tmp_path):
    """A write that fails (here: a file size limit, as a full disk) is one line, exit 2, and leaves
    the schema written before whole, with no temporary file beside it."""
    target = tmp_path / "policy.schema.json"
    assert run(capsys, "schema", "-o", str(target))[0] == 0
    before = target.read_bytes()
    assert len(before) > 2048
    target.write_bytes(before[:-1] + b" ")  # a good schema, told apart from the one the next run writes
    kept = target.read_bytes()
    with file_size_limit(2048):
        code, _, err = run(capsys, "schema", "-o", str(target))
    assert code == 2 and err.startswith("kvpolicy: error: ") and err.count("\n") == 1, err
    assert target.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    for bad, message in ((tmp_path, "is a directory"), (tmp_path / "no" / "s.json", "no such folder")):
        code, _, err = run(capsys, "schema", "-o", str(bad))
        assert code == 2 and message in err, err


def test_schema_lists_every_registered_stage():
    schema = policy_json_schema()
    defs = schema["$defs"]
    for kind, table in get_registry().stages.items():
        union = defs[UNION_DEFS[kind]]
        tagged = union["anyOf"][0] if "anyOf" in union else union
        assert set(tagged["discriminator"]["mapping"]) == set(table)
        for type_name in table:
            variant = defs[f"{kind}.{type_name}"]
            assert variant["properties"]["type"] == {
                "const": type_name,
                "description": variant["properties"]["type"]["description"],
            }
            assert "type" in variant["required"]
            assert {"$ref": f"#/$defs/{kind}.{type_name}"} in tagged["oneOf"]


def test_schema_nested_scorers_reference_the_union():
    defs = policy_json_schema()["$defs"]
    assert defs["reservation.top_scores"]["properties"]["scorer"] == {"$ref": "#/$defs/ScorerSpec"}
    terms = defs["scorer.combination"]["properties"]["terms"]["items"]["$ref"]
    term = defs[terms.removeprefix("#/$defs/")]
    assert term["properties"]["scorer"] == {"$ref": "#/$defs/ScorerSpec"}
    # No leftover base-class definitions that would accept any object.
    assert not {"Scorer", "Reservation", "Selector", "Stage"} & set(defs)


def test_schema_refs_all_resolve():
    schema = policy_json_schema()

    def refs(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item)

    for ref in refs(schema):
        assert ref.startswith("#/$defs/")
        assert ref.removeprefix("#/$defs/") in schema["$defs"], ref


def test_schema_schedule_fields_come_from_schedule():
    schedule = policy_json_schema()["$defs"]["Schedule"]
    assert set(schedule["properties"]) == set(kvpolicy.Schedule.model_fields)
    assert schedule["required"] == ["budget"]
    recent = schedule["properties"]["recent"]
    assert {"type": "integer", "minimum": 0} in recent["anyOf"]
    assert any(branch.get("type") == "string" and "pattern" in branch for branch in recent["anyOf"])
    validator = _validator({**policy_json_schema()["$defs"]["Schedule"], "$defs": policy_json_schema()["$defs"]})
    assert list(validator.iter_errors({"budget": 8, "recent": 2, "evict_above": "recent"})) == []
    assert list(validator.iter_errors({"budget": 8, "evict_above": "budget"})) != []


def _validator(schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_is_valid_json_schema_and_accepts_every_builtin_policy():
    validator = _validator(policy_json_schema())
    builtins = sorted(name for name, p in get_registry().policies.items() if p.plugin == "kvpolicy")
    assert set(BUILTIN_POLICIES) < set(builtins)
    for name in builtins:  # every one shipped, dms's evict_above: recent included
        source = get_registry().policies[name].obj
        data = yaml.safe_load(source.read_text())
        errors = [e.message for e in validator.iter_errors(data)]
        assert errors == [], (name, errors)
        # The resolved form (as `show` prints it) validates too.
        assert list(validator.iter_errors(kvpolicy.load_policy(name).config.to_dict())) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["scorer"].update(type="no_such_scorer"),
        lambda d: d["scorer"].update(kernel="five"),
        lambda d: d["scorer"].update(unknown_field=1),
        lambda d: d["schedule"].update(recent="budget + 4"),
        lambda d: d["reservations"][1]["scorer"].update(type="greedy"),
        lambda d: d.update(extra=True),
        lambda d: d.pop("selector"),
    ],
)
def test_schema_rejects_what_load_policy_rejects(mutate):
    validator = _validator(policy_json_schema())
    data = yaml.safe_load(get_registry().policies["vase-attnv"].obj.read_text())
    assert list(validator.iter_errors(data)) == []
    mutate(data)
    assert list(validator.iter_errors(data)) != []


def test_schema_accepts_relative_recent_and_bare_stage_names():
    validator = _validator(policy_json_schema())
    data = {
        "name": "x",
        "schedule": {"budget": 64, "recent": "budget - 4"},
        "scorer": "random",
        "reservations": ["sinks"],
        "selector": "greedy",
    }
    assert list(validator.iter_errors(data)) == []
    kvpolicy.load_policy(data)  # and the library agrees


class EveryOther(Selector):
    """Keeps every other candidate (a test plugin's selector)."""

    type_name: ClassVar[str] = "every_other_test"

    offset: int = 0

    def priority(self, scores, inp):
        idx = torch.arange(inp.num_slots, dtype=torch.float32)
        return ((idx + self.offset) % 2 == 0).float().expand(inp.keys.shape[:3])


class EveryOtherPlugin(Contract2Plugin):
    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [EveryOther]


def test_runtime_plugin_appears_in_schema_and_cli(capsys):
    get_registry().register_plugin(EveryOtherPlugin(), name="every-other")
    schema = policy_json_schema()
    variant = schema["$defs"]["selector.every_other_test"]
    assert variant["x-kvpolicy-plugin"] == "every-other"
    assert variant["properties"]["offset"]["type"] == "integer"
    data = {
        "name": "alt",
        "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 0},
        "scorer": {"type": "random"},
        "selector": {"type": "every_other_test", "offset": 1},
    }
    try:
        validator = _validator(schema)
    except pytest.skip.Exception:
        validator = None
    if validator is not None:
        assert list(validator.iter_errors(data)) == []
    policy = kvpolicy.load_policy(data)
    keys = torch.randn(1, 1, 12, 4)
    assert policy.select(keys, keys, torch.zeros(1, 1, 0, 4)).shape == (1, 1, 8)
    code, out, _ = run(capsys, "policies")
    assert code == 0
    assert any(ln.startswith("every_other_test ") and "every-other" in ln for ln in out.splitlines())


# -- eval wiring --------------------------------------------------------------------------------
def test_eval_without_harness_says_so(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpolicy.eval.cli", None)  # import now raises ImportError
    code, out, err = run(capsys, "eval", "--anything")
    assert code == 2
    assert "the evaluation harness is not installed" in err
    assert "Traceback" not in err


def test_eval_uses_the_harness_parser(capsys, monkeypatch):
    seen = {}

    def add_eval_parser(subparsers):
        p = subparsers.add_parser("eval")
        p.add_argument("--budget", type=int)
        p.set_defaults(func=lambda args: seen.setdefault("budget", args.budget) and 0)

    fake = types.ModuleType("kvpolicy.eval.cli")
    fake.add_eval_parser = add_eval_parser
    monkeypatch.setitem(sys.modules, "kvpolicy.eval.cli", fake)
    code, _, _ = run(capsys, "eval", "--budget", "128")
    assert code == 0
    assert seen == {"budget": 128}


# -- helpers and the installed command ----------------------------------------------------------
def test_helpers():
    assert parse_overrides(["budget=512", "recent=budget - 4", "compress_prompt=true"]) == {
        "budget": 512,
        "recent": "budget - 4",
        "compress_prompt": True,
    }
    assert locate_problem("a.yaml", "line 3: schedule.budget: bad") == "a.yaml:3: schedule.budget: bad"
    assert locate_problem("a.yaml", "line 2, column 5: not valid YAML") == "a.yaml:2:5: not valid YAML"
    assert locate_problem("a.yaml", "no line") == "a.yaml: no line"
    assert first_sentence("One. Two.\n\nThree.") == "One."


def test_module_entry_point_exits_cleanly():
    result = subprocess.run(
        [sys.executable, "-m", "kvpolicy.cli", "show", "no-such-policy"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown policy" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_reader_that_leaves_is_not_an_error():
    """`kvpolicy policies | head -5`: the reader closes the pipe before the listing is written.
    The command ends quietly with the shell's SIGPIPE code, not `kvpolicy: error: Broken pipe`."""
    proc = subprocess.Popen([sys.executable, "-m", "kvpolicy.cli", "policies"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has imported torch, let alone written a line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


# -- every bad policy document: exit 2 (show) or 1 (validate), one line on stderr ----------------
def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvpolicy: error: ")
    return lines[0]


GOOD_FILE = """\
name: mine
schedule: {budget: 64, recent: 8, interval: 8, window: 8}
scorer: {type: attention}
selector: {type: greedy}
"""

BAD_DOCUMENTS = {
    "non-utf8": GOOD_FILE.replace("name: mine", "name: caf\xe9").encode("latin-1"),
    "recursive-alias": b"a: &a [*a]\n",
    "deep": (GOOD_FILE + "description: " + "[" * 3000 + "]" * 3000 + "\n").encode(),
    "huge-int": ("seed: " + "9" * 5000 + "\n" + GOOD_FILE).encode(),
    "seed-2**64": (f"seed: {2**64}\n" + GOOD_FILE).encode(),
    "kernel": GOOD_FILE.replace("{type: attention}", "{type: attention, kernel: 2147483649}").encode(),
    "duplicate-key": (GOOD_FILE + "name: again\n").encode(),
    "many-problems": b"name: x\nschedule: {budget: -1, recent: -1}\nselector: nope\nextra: 1\n",
    "nul-byte": GOOD_FILE.replace("mine", "mi\x00ne").encode(),
}


@pytest.mark.parametrize("kind", sorted(BAD_DOCUMENTS))
def test_show_bad_document_is_one_line_exit_2(capsys, tmp_path, kind):
    path = tmp_path / f"{kind}.yaml"
    path.write_bytes(BAD_DOCUMENTS[kind])
    code, out, err = run(capsys, "show", str(path))
    assert code == 2
    assert out == ""
    assert str(path) in _one_error_line(err)


@pytest.mark.parametrize("kind", sorted(BAD_DOCUMENTS))
def test_validate_bad_document_exit_1(capsys, tmp_path, kind):
    path = tmp_path / f"{kind}.yaml"
    path.write_bytes(BAD_DOCUMENTS[kind])
    code, out, err = run(capsys, "validate", str(path))
    assert code == 1
    assert "Traceback" not in err and err.strip() == "1 of 1 policy file(s) invalid"
    assert out.strip() and all(line.startswith(f"{path}") for line in out.splitlines())


def test_show_several_problems_on_one_line(capsys, tmp_path):
    path = tmp_path / "multi.yaml"
    path.write_bytes(BAD_DOCUMENTS["many-problems"])
    code, _, err = run(capsys, "show", str(path))
    line = _one_error_line(err)
    assert code == 2
    assert f"{path}:2: schedule.budget:" in line and "; " in line and "extra" in line


@pytest.mark.parametrize(
    "value,pattern",
    [
        (str(2**64), "seed"),
        ("-1", "seed"),
        ("9" * 5000, "seed"),
        ("&a [*a]", "seed"),
        ("[" * 3000, "seed"),
        (".nan", "seed"),
    ],
)
def test_show_bad_seed_override_is_one_line_exit_2(capsys, value, pattern):
    code, out, err = run(capsys, "show", "snapkv", "--set", f"seed={value}")
    assert code == 2
    assert out == ""
    assert pattern in _one_error_line(err)


def test_show_override_on_a_schedule_that_is_not_a_mapping(capsys, tmp_path):
    path = tmp_path / "sched.yaml"
    path.write_text("name: x\nschedule: 5\nselector: greedy\n")
    code, _, err = run(capsys, "show", str(path), "--budget", "64")
    assert code == 2
    assert "schedule is not a mapping" in _one_error_line(err)


def test_show_seed_override_within_int64(capsys):
    code, out, _ = run(capsys, "show", "snapkv", "--set", f"seed={2**63 - 1}")
    assert code == 0
    assert yaml.safe_load(out)["seed"] == 2**63 - 1


# -- calibrate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["-o", "q.pt"], "--output must end in .safetensors"),
    (["-o", "no/such/folder/q.safetensors"], "--output: no such folder"),
    (["-o", "q.safetensors", "--tokens", "1"], "--tokens must be at least 2"),
])
def test_calibrate_refuses_bad_arguments_before_loading_a_model(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "calibrate", *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize("target, message", [
    ("d.safetensors", "--output: d.safetensors is a directory"),
    ("ro/q.safetensors", "--output: cannot write into ro (permission denied or a read-only file system)"),
])
def test_calibrate_refuses_an_unwritable_output_before_loading_a_model(capsys, tmp_path, monkeypatch, target, message):
    import kvpolicy.eval.models as models
    import kvpolicy.files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.safetensors").mkdir()
    (tmp_path / "ro").mkdir()
    real_access = kvpolicy.files.os.access  # a read-only mount (chmod does not stop root, who runs some CIs)
    monkeypatch.setattr(kvpolicy.files.os, "access", lambda p, m: str(p) != "ro" and real_access(p, m))
    monkeypatch.setattr(models, "resolve_model", lambda spec: pytest.fail("the model was looked for"))
    code, _, err = run(capsys, "calibrate", "-o", target)
    assert code == 2 and err == f"kvpolicy: error: {message}\n"


def _calibrate_on_tiny_qwen3(monkeypatch, tmp_path):
    """``kvpolicy calibrate`` on a tiny random Qwen3 (2 layers, vocab 64) and a tokenizer of
    ids 3..62 (its ``--text``: ``text.txt``, 460 tokens)."""
    from hf_util import tiny_qwen3

    import kvpolicy.eval.models as models

    model = tiny_qwen3(layers=2, vocab=64)
    source = models.ModelSource("tiny", tmp_path)

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + ord(c) % 60 for c in text]}

    monkeypatch.setattr(models, "resolve_model", lambda spec: source)
    monkeypatch.setattr(models, "load_tokenizer", lambda src: Tokenizer())
    monkeypatch.setattr(models, "load_model", lambda src, dtype, device: model)
    text = tmp_path / "text.txt"
    text.write_text("some calibration prose " * 20, encoding="utf-8")
    return text


def test_calibrate_reports_a_failed_write_on_one_line_and_leaves_no_file(capsys, tmp_path, monkeypatch):
    """A write that fails after the model ran (a full disk: here a file size limit) is one line,
    exit 2, naming the file; no partial file is left."""
    pytest.importorskip("transformers")
    text = _calibrate_on_tiny_qwen3(monkeypatch, tmp_path)
    out = tmp_path / "tiny.safetensors"
    with file_size_limit(1024):
        code, _, err = run(capsys, "calibrate", "--text", str(text), "--tokens", "200", "-o", str(out))
    assert code == 2 and err.splitlines()[-1] == f"kvpolicy: error: --output: cannot write {out}: File too large"
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_calibrate_writes_a_file_the_triattention_scorer_loads(capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    text = _calibrate_on_tiny_qwen3(monkeypatch, tmp_path)
    out = tmp_path / "tiny.safetensors"
    code, _, err = run(capsys, "calibrate", "--text", str(text), "--tokens", "200", "-o", str(out))
    assert code == 0, err
    assert "2 layers x 4 query heads x 8 frequency pairs" in err
    cal = kvpolicy.stages.QueryCalibration.load(out)
    assert cal.shape["num_layers"] == 2 and cal.info["tokens"] == "200"
    code, _, err = run(capsys, "calibrate", "--text", str(text), "--tokens", "5000", "-o", str(out))
    assert code == 2 and "--tokens: the text has 460 tokens, fewer than the 5000 asked for" in err


def test_calibrate_adds_the_models_fingerprint_to_a_file_measured_before_fingerprints(capsys, tmp_path, monkeypatch):
    """``--add-fingerprint FILE``: FILE's statistics, with the fingerprint of the model loaded, which
    then serves that model and refuses another of its shape; a model of another shape is refused."""
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3
    from safetensors.torch import load_file, save_file

    import kvpolicy.eval.models as models
    from kvpolicy.hf.facts import model_facts

    model = tiny_qwen3(layers=2, vocab=64)
    models_by_name = {"tiny": model, "other": tiny_qwen3(layers=2, vocab=64, seed=1), "deep": tiny_qwen3(layers=3, vocab=64)}
    for name, m in models_by_name.items():  # as loaded from a folder of that name
        m.config._name_or_path = name
    monkeypatch.setattr(models, "resolve_model", lambda spec: models.ModelSource(spec, tmp_path))
    monkeypatch.setattr(models, "load_model", lambda src, dtype, device: models_by_name[src.name])
    from kvpolicy.calibrate import measure_query_calibration

    measured = measure_query_calibration(model, torch.arange(3, 40))
    measured.save(tmp_path / "new.safetensors")
    old = tmp_path / "old.safetensors"  # as kvpolicy wrote it before fingerprints
    save_file({k: t for k, t in load_file(str(tmp_path / "new.safetensors")).items() if not k.startswith("fingerprint")},
              str(old), metadata={"kvpolicy_calibration": "1", "model": "tiny", "num_layers": "2",
                                  "num_attention_heads": "4", "num_kv_heads": "2", "head_dim": "16"})
    out = tmp_path / "stamped.safetensors"
    code, _, err = run(capsys, "calibrate", "--model", "tiny", "--add-fingerprint", str(old), "-o", str(out))
    assert code == 0, err
    stamped = kvpolicy.stages.QueryCalibration.load(out)
    assert stamped.model == "tiny" and torch.equal(stamped.q_mean, measured.q_mean)
    assert torch.equal(stamped.q_abs_mean, measured.q_abs_mean)
    assert torch.equal(stamped.fingerprint.o_proj, measured.fingerprint.o_proj)
    stamped.check_model(model_facts(model))
    with pytest.raises(ValueError, match="another model: its weights differ"):
        stamped.check_model(model_facts(models_by_name["other"]))
    code, _, err = run(capsys, "calibrate", "--model", "deep", "--add-fingerprint", str(old), "-o", str(out))
    assert code == 2 and "num_layers = 2, but the model" in err
    # A file that records a fingerprint already: another model's is refused, naming both (it was
    # replaced before: the file then claimed a model it was not measured on); the same model's adds nothing.
    again = tmp_path / "again.safetensors"
    code, _, err = run(capsys, "calibrate", "--model", "other", "--add-fingerprint", str(out), "-o", str(again))
    assert code == 2 and not again.exists()
    assert err.startswith(f"kvpolicy: error: calibration {out} already records the fingerprint of the model it was "
                          "measured on, 'tiny'; 'other' is another model (its weights differ"), err
    code, _, err = run(capsys, "calibrate", "--model", "tiny", "--add-fingerprint", str(out), "-o", str(again))
    assert code == 0 and f"wrote {again}: nothing added, {out} already records the fingerprint of tiny" in err
    copy, stamped = kvpolicy.stages.QueryCalibration.load(again), kvpolicy.stages.QueryCalibration.load(out)
    assert copy == stamped and copy.info == stamped.info
    assert torch.equal(copy.fingerprint.o_proj, stamped.fingerprint.o_proj)


@pytest.mark.parametrize("argv, message", [
    (["--text", "t.txt"], "--text and --tokens are for measuring; --add-fingerprint measures nothing"),
    (["--tokens", "64"], "--text and --tokens are for measuring; --add-fingerprint measures nothing"),
    ([], "no such calibration file: old.safetensors"),
])
def test_calibrate_add_fingerprint_refuses_before_loading_the_model(capsys, tmp_path, monkeypatch, argv, message):
    import kvpolicy.eval.models as models

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(models, "resolve_model", lambda spec: models.ModelSource(spec, tmp_path))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run(capsys, "calibrate", "--add-fingerprint", "old.safetensors", *argv, "-o", "new.safetensors")
    assert code == 2 and err.startswith(f"kvpolicy: error: {message}"), err


def test_python_dash_m_runs_the_command_line():
    """``python -m kvpolicy`` is the ``kvpolicy`` command (found from outside: there was no
    ``__main__``), exit code included."""
    ok = subprocess.run([sys.executable, "-m", "kvpolicy", "show", "snapkv"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "snapkv" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvpolicy", "show", "no-such-policy"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "no-such-policy" in bad.stderr
