"""``benchmarks/select_bench.py`` (``make bench``) times every built-in policy that random tensors
can serve. A tiny run: the numbers are not checked, only that every policy of its default list
is timed (per-head counts through ``select_heads``, a prompt length where one is read), that a
policy bound to a model's shape is skipped by name, and that the loop column appears only for
the policies the loop implements."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

import kvpolicy

select_bench = load_benchmark("select_bench")


def test_every_default_policy_is_timed_or_skipped_by_name(capsys):
    threads = torch.get_num_threads()
    try:
        select_bench.main(["--batch", "1", "--slots", "200", "--budget", "160", "--kv-heads", "2", "--q-heads", "4",
                           "--head-dim", "8", "--window", "8", "--repeats", "1", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[3:] if line.strip()}
    registry = kvpolicy.get_registry()
    expected = {n for n, r in registry.policies.items() if r.plugin == "kvpolicy" and not kvpolicy.load_policy(n).needs_model}
    assert set(rows) == expected
    assert "skipped: allocation: profile" in rows["duo-attention"]  # bound to the bundled model's 30 x 3 heads
    for name in ("ada-snapkv", "dms", "random-prompt", "cake"):  # per-head counts, a prompt, a prompt's budgets
        assert len(rows[name].split()) == 8 and rows[name].split()[-1] == "-", rows[name]
    assert rows["snapkv"].split()[-1].endswith("x") and rows["snapkv-paper"].split()[-1] == "-"


@pytest.mark.parametrize("name", ["snapkv", "vase-attnv", "curdkv", "streamingllm"])
def test_the_loop_covers_the_policies_it_implements(name):
    assert select_bench.LoopPolicy.covers(kvpolicy.load_policy(name))


@pytest.mark.parametrize("name", ["snapkv-paper", "h2o", "ada-snapkv", "pyramidkv", "snapkv-merge", "quest", "tova"])
def test_the_loop_leaves_out_what_it_does_not_implement(name):
    assert not select_bench.LoopPolicy.covers(kvpolicy.load_policy(name))


@pytest.mark.parametrize(("names", "message"), [
    (["snapkv", "triattention"], "triattention: the policy reads the model"),
    (["criticalkv", "expected-attention"], "criticalkv, expected-attention: the policy reads the model"),
    (["nope"], "unknown policy 'nope'"),
])
def test_a_policy_random_tensors_cannot_serve_is_refused_before_any_timing(capsys, names, message):
    with pytest.raises(SystemExit) as exit_:
        select_bench.main(["--policies", *names, "--repeats", "1"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err.splitlines()[-1], err
    assert out == ""  # refused before the table began
