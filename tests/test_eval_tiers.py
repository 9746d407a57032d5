"""A two-tier policy's tiers in ``kvpolicy eval``: measured where the memory figures are (the
decoding loop, ``speed``), reported beside them, and consistent with ``tier_stats()``; a run
without a two-tier policy reports exactly what it did before (tiny random models)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("reasoning_gym")
pytest.importorskip("matplotlib")

from test_eval_e2e import build_tiny_model  # noqa: E402

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.eval.cli import main  # noqa: E402
from kvpolicy.eval.cost import cache_tier_stats  # noqa: E402
from kvpolicy.eval.decoding import Prompt, Stream, generate_batch, new_cache  # noqa: E402
from kvpolicy.eval.metrics.base import Column  # noqa: E402
from kvpolicy.eval.progress import LineProgress, format_bytes  # noqa: E402
from kvpolicy.eval.report import markdown_table, shown_columns  # noqa: E402
from kvpolicy.eval.sampling import SamplingParams  # noqa: E402

#: SnapKV's eviction with a second tier: budget 96 (what the runs below override it with), evictions
#: of 16 tokens after the prompt (whole pages), 32 recalled slots per KV head at every decode token.
TWO_TIER = {
    "name": "snapkv-two-tier", "seed": 0, "schedule": {"budget": 96, "recent": 32, "interval": 16, "window": 16},
    "scorer": {"type": "attention", "pooling": "avg", "kernel": 5, "group_reduce": "mean",
               "group_reduce_at": "after_softmax", "window_reduce": "mean"},
    "selector": {"type": "greedy"},
    "recall": {"budget": 32, "page_size": 16, "interval": 1, "scorer": {"type": "quest"}},
}
TIER_COLUMNS = ("fast_mib", "slow_mib", "moved_kib_tok", "hit_rate")
TIER_COUNTS = ("moved_bytes", "written_bytes", "pages_recalled", "recall_hits", "pages_dropped", "decode_tokens")
SPEED = ["--metrics", "speed", "--budgets", "96", "--set", "speed.context=200", "--set", "speed.new_tokens=16",
         "--no-progress"]
#: What ``speed`` reported before two tiers, and still reports for every other policy.
SPEED_HEADER = "| policy | budget | tok/s | KV MiB | KV MiB held | peak MiB |"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def two_tier_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "snapkv-two-tier.yaml"
    path.write_text(yaml.safe_dump(TWO_TIER))
    return path


def _load(tiny_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def _rows(run: Path) -> dict[str, dict]:
    return {r["key"]: r["values"] for r in json.loads((run / "metrics.json").read_text())["rows"]}


# -- the decoding loop ----------------------------------------------------------------------------------
def test_a_batch_counts_a_two_tier_caches_tiers_as_tier_stats_does_rows_leaving_included(tiny_model):
    """``generate_batch`` reads the tiers where it reads the KV bytes: the peaks are at least the
    last reading, the counters are ``tier_stats()``'s, and a padded batch whose rows finish at
    different steps (and leave it) moves, recalls and hits exactly what its rows do alone."""
    model, tokenizer = _load(tiny_model)
    policy = load_policy(TWO_TIER)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (170, 181)]
    params = SamplingParams(max_new_tokens=40)
    free = [generate_batch(model, new_cache(model, policy), tokenizer, [Prompt(ids)], params, [])[0][0].tokens
            for ids in prompts]
    eos = frozenset({free[0][12]})  # the first row stops at (or before) its 13th token, the other goes on

    alone = [generate_batch(model, new_cache(model, policy), tokenizer, [Prompt(ids)], params, eos)
             for ids in prompts]
    cache = new_cache(model, policy)
    gens, stats = generate_batch(model, cache, tokenizer, [Prompt(ids) for ids in prompts], params, eos)
    assert [g.tokens for g in gens] == [a[0][0].tokens for a in alone]
    assert len(gens[0].tokens) < len(gens[1].tokens) == 40  # a row left the batch while the other decoded

    final = cache.tier_stats()
    tiers = stats.tiers
    assert final is not None and tiers is not None
    assert tiers.moved_bytes == final.moved_bytes > 0
    assert tiers.hits == final.hits > 0 and tiers.pages_recalled == final.pages_recalled > tiers.hits
    assert tiers.written_bytes == final.written_bytes > 0 and tiers.pages_dropped == final.pages_dropped == 0
    assert tiers.fast_bytes >= final.fast_bytes > 0 and tiers.slow_bytes >= final.slow_bytes > 0
    assert tiers.decode_tokens == stats.new_tokens - len(prompts)
    # Rows recall on their own: the batch's counters are its rows' alone.
    for name in ("moved_bytes", "hits", "pages_recalled", "written_bytes", "decode_tokens"):
        assert getattr(tiers, name) == sum(getattr(a[1].tiers, name) for a in alone), name

    _, plain = generate_batch(model, new_cache(model, load_policy("snapkv", budget=96)), tokenizer,
                              [Prompt(prompts[0])], params, [])
    assert plain.tiers is None  # one tier: nothing measured, nothing reported
    assert cache_tier_stats(new_cache(model, None)) is None  # the full cache (a DynamicCache)


# -- kvpolicy eval ----------------------------------------------------------------------------------------
def test_eval_reports_a_two_tier_policys_tiers_consistent_with_tier_stats(tiny_model, two_tier_file, tmp_path,
                                                                          capsys):
    run = tmp_path / "run"
    assert main(["eval", "--model", str(tiny_model), "--policies", str(two_tier_file), "snapkv", *SPEED,
                 "--out", str(run)]) == 0, capsys.readouterr().err
    rows = _rows(run)
    two, plain, full = rows["snapkv-two-tier@96"], rows["snapkv@96"], rows["full"]
    assert not set(TIER_COLUMNS + TIER_COUNTS) & (set(plain) | set(full))  # nothing new for one tier
    assert two["decode_tokens"] == 15  # the timed decode steps
    assert two["moved_bytes"] > 0 and two["recall_hits"] > 0 and two["fast_mib"] > 0 and two["slow_mib"] > 0
    assert two["hit_rate"] == pytest.approx(two["recall_hits"] / two["pages_recalled"])
    assert two["moved_kib_tok"] == pytest.approx(two["moved_bytes"] / two["decode_tokens"] / 1024)

    # The same decode, replayed by hand through a Stream: the figures are tier_stats()'s.
    from kvpolicy.eval.data import read_text, text_ids
    from kvpolicy.eval.models import load_model, resolve_model

    model = load_model(resolve_model(str(tiny_model)), "float32", "cpu")
    _, tokenizer = _load(tiny_model)
    ids = text_ids(tokenizer, read_text(None)[0])[:200]
    stream = Stream(model, load_policy(str(two_tier_file), budget=96))
    stream.feed(ids[:64])
    logits = stream.feed(ids[64:])
    before = stream.cache.tier_stats()
    stream.generate(logits, SamplingParams(max_new_tokens=16))
    after = stream.cache.tier_stats()
    assert two["moved_bytes"] == after.moved_bytes - before.moved_bytes
    assert two["recall_hits"] == after.hits - before.hits
    assert two["pages_recalled"] == after.pages_recalled - before.pages_recalled
    assert two["fast_mib"] == after.fast_bytes / 2**20 and two["slow_mib"] == after.slow_bytes / 2**20

    # The report: the tier columns beside the memory ones, "-" for the policies without tiers.
    table = (run / "table.md").read_text().splitlines()
    assert table[0] == SPEED_HEADER + " fast MiB | slow MiB | moved KiB/tok | recall hits |"
    assert next(line for line in table if line.startswith("| snapkv |")).endswith("| - | - | - | - |")
    summary = json.loads((run / "metrics.json").read_text())
    assert [c["key"] for c in summary["columns"]][-4:] == list(TIER_COLUMNS)
    assert all((run / "plots" / f"{key}.png").is_file() for key in TIER_COLUMNS)


def test_eval_without_a_two_tier_policy_reports_what_it_did_before(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["eval", "--model", str(tiny_model), "--policies", "snapkv", *SPEED, "--out", str(run)]) == 0, \
        capsys.readouterr().err
    assert (run / "table.md").read_text().splitlines()[0] == SPEED_HEADER
    summary = json.loads((run / "metrics.json").read_text())
    assert [c["key"] for c in summary["columns"]] == ["tokens_per_s", "kv_mib", "kv_held_mib", "peak_mib"]
    assert all(set(r["values"]) == {"tokens_per_s", "kv_mib", "kv_held_mib", "peak_mib"} for r in summary["rows"])
    assert not any((run / "plots" / f"{key}.png").exists() for key in TIER_COLUMNS)
    assert "fast MiB" not in capsys.readouterr().out  # the terminal table


def test_batched_speed_reports_the_tiers_of_every_row(tiny_model, two_tier_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["eval", "--model", str(tiny_model), "--policies", str(two_tier_file), *SPEED,
                 "--set", "speed.batch=2", "--out", str(run)]) == 0, capsys.readouterr().err
    two = _rows(run)["snapkv-two-tier@96"]
    assert two["decode_tokens"] == 2 * 15 and two["moved_bytes"] > 0 and two["fast_mib"] > 0
    assert math.isfinite(two["moved_kib_tok"]) and 0 < two["hit_rate"] <= 1


# -- the report and the progress line ----------------------------------------------------------------------
def test_optional_columns_show_only_where_a_row_reports_them():
    cols = [Column("kv_mib", "KV MiB", "{:.2f}", "lower"), Column("fast_mib", "fast MiB", "{:.2f}", optional=True)]
    plain = [{"key": "a@8", "policy": "a", "budget": 8, "values": {"kv_mib": 1.0}}]
    assert shown_columns(cols, plain) == cols[:1]
    assert markdown_table(cols, plain).splitlines()[0] == "| policy | budget | KV MiB |"
    two = plain + [{"key": "b@8", "policy": "b", "budget": 8, "values": {"kv_mib": 1.0, "fast_mib": 0.5}}]
    assert markdown_table(cols, two).splitlines()[0] == "| policy | budget | KV MiB | fast MiB |"


def test_the_progress_line_shows_the_bytes_moved_of_a_two_tier_policy_only():
    one = LineProgress("snapkv@96 t", 4, every=0, stream=io.StringIO())
    one.update(1, tokens=100)
    assert "moved" not in one.line()
    two = LineProgress("snapkv-recall@96 t", 4, every=0, stream=io.StringIO())
    two.update(1, tokens=100, moved=3 * 2**20)
    two.update(1, tokens=100, moved=0)
    assert "moved 3.0 MiB (15.4 KiB/tok)" in two.line()
    assert [format_bytes(n) for n in (512, 1536, 5 * 2**30)] == ["512 B", "1.5 KiB", "5.0 GiB"]
