"""The padded-row check (``kvpolicy.hf.padded_rows``): end to end only where the full cache is
batch-invariant on the machine running it, kvpolicy's own part on replayed inputs elsewhere.

A model is made batch-dependent on purpose (a forward hook that shifts its hidden states when
it runs a batch of more than one row), which is what some CPUs' bfloat16 kernels do by accident;
kvpolicy defects that only padded batches show are planted by wrapping ``EvictingCache.attend``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from hf_util import fresh, left_padded_prompt, tiny_qwen3  # noqa: E402

from kvpolicy import KVPolicyCache, load_policy  # noqa: E402
from kvpolicy.evicting import EvictingCache  # noqa: E402
from kvpolicy.hf import padded_rows  # noqa: E402
from kvpolicy.hf.padded_rows import END_TO_END, REPLAYED, FullCacheRun, check_padded_rows, record_calls  # noqa: E402

VOCAB = 512
N = 40
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3(layers=2, vocab=VOCAB)


def _policy(name="snapkv"):
    over = {"budget": 24, "recent": 6} if name == "quest" else {"budget": 24, "recent": 6, "window": 6, "interval": 4}
    return load_policy(name, **over)


def _batch_dependent(model):
    """The model, shifted by 0.05 in its first layer's MLP output whenever it runs more than one
    row: a full cache that is not batch-invariant, whatever the machine."""
    def shift(module, args, output):
        return output + 0.05 if output.shape[0] > 1 else output

    model.model.layers[0].mlp.register_forward_hook(shift)
    return model


@pytest.fixture
def plant(monkeypatch):
    """Plant a defect in kvpolicy's part that only a padded batch shows (row 1 of a batch of 2)."""
    def planted(kind: str):
        attend = EvictingCache.attend

        def defective(self, layer_idx, queries, keys, values, token_valid=None, *, scaling=None):
            if queries.shape[0] > 1 and kind == "keys":  # row 1 stores altered keys
                keys = keys.clone()
                keys[1] += 0.5
            out = attend(self, layer_idx, queries, keys, values, token_valid, scaling=scaling)
            if queries.shape[0] > 1 and kind == "outputs":  # row 1 attends wrongly
                out = out.clone()
                out[1] += 0.01
            return out

        monkeypatch.setattr(EvictingCache, "attend", defective)
    return planted


@pytest.mark.parametrize("name", ["snapkv", "quest"])
def test_a_full_cache_that_is_not_batch_invariant_sends_the_check_to_replayed_inputs(qwen3, name):
    """The policy's padded row parts from the row alone (the model's doing), so an end-to-end
    assertion would fail here; the check measures the full cache first and tests kvpolicy's part."""
    model = _batch_dependent(fresh(qwen3))
    ids, mask = left_padded_prompt(VOCAB, length=20, pads=(0, 7), seed=2)
    rows = check_padded_rows(model, _policy(name), ids, mask, N)
    for row in rows:
        assert not row.full_cache.batch_invariant and row.full_cache.tokens_from is not None
        assert row.method == REPLAYED and row.passed, row.verdict
        assert "policy parts at token" in row.detail  # end to end it did differ
        assert row.verdict.startswith(f"full cache not batch-invariant here (parts at token {row.full_cache.tokens_from})")
        assert row.verdict.endswith("kvpolicy's part exact on replayed inputs")


@pytest.mark.parametrize("kind, what", [("keys", "held keys"), ("outputs", "attention outputs")])
def test_the_replay_runs_and_catches_what_only_a_padded_batch_gets_wrong(qwen3, plant, kind, what):
    """Where the full cache is not batch-invariant, a defect of kvpolicy's still fails the check:
    were the replay skipped (the difference put down to the model), this would pass."""
    model = _batch_dependent(fresh(qwen3))
    ids, mask = left_padded_prompt(VOCAB, length=20, pads=(0, 7), seed=2)
    plant(kind)
    rows = check_padded_rows(model, _policy(), ids, mask, N)
    assert rows[0].passed  # the defect touches row 1 only
    assert rows[1].method == REPLAYED and not rows[1].passed
    assert what in rows[1].detail and "FAILS on replayed inputs" in rows[1].verdict


def test_where_the_full_cache_is_batch_invariant_the_tokens_must_match(qwen3, plant, monkeypatch):
    """A full cache with bit-identical logits leaves the model's kernels no excuse: a padded row
    that parts from its tokens alone fails end to end, with no replay."""
    model = fresh(qwen3)
    ids, mask = left_padded_prompt(VOCAB, length=20, pads=(0, 7), seed=2)
    monkeypatch.setattr(padded_rows, "_full_cache_runs", lambda *a: [FullCacheRun(None, None)] * 2)
    monkeypatch.setattr(padded_rows, "replay_padded", lambda *a, **k: pytest.fail("no replay where the model is invariant"))
    plant("outputs")
    rows = check_padded_rows(model, _policy(), ids, mask, N)
    assert rows[0].passed and rows[0].method == END_TO_END
    assert rows[1].method == END_TO_END and not rows[1].passed and rows[1].first_difference is not None
    assert rows[1].verdict.startswith("FAIL end to end")


def test_an_exact_policy_passes_end_to_end_in_float32(qwen3):
    ids, mask = left_padded_prompt(VOCAB, length=20, pads=(0, 7), seed=2)
    for row in check_padded_rows(fresh(qwen3), _policy("vase-attnv"), ids, mask, N):
        assert row.passed and row.method == END_TO_END and row.verdict == "exact end to end"


def test_replay_of_correct_traces_agrees_and_needs_aligned_alone_traces(qwen3):
    model = fresh(qwen3)
    ids, mask = left_padded_prompt(VOCAB, length=20, pads=(0, 7), seed=2)
    policy = _policy("ada-snapkv")  # per-head budgets: heads hold different counts
    traces = []
    for r in range(2):
        cache = KVPolicyCache(policy, model)
        with record_calls(cache) as calls:
            padded_rows._generate(model, cache, ids[r : r + 1, mask[r].bool()], None, N)
        assert "attend" not in vars(cache.evicting)  # the recorder is gone after the block
        traces.append(calls)
    assert len(traces[0]) == 2 * N and traces[0][0].keys.shape[2] == 20 and traces[1][0].keys.shape[2] == 13
    assert padded_rows.replay_padded(policy, traces, num_kv_heads=2) == [None, None]
    with pytest.raises(ValueError, match="same calls"):
        padded_rows.replay_padded(policy, [traces[0], traces[1][:-1]])


def test_right_padding_is_refused(qwen3):
    ids, mask = left_padded_prompt(VOCAB, length=12, pads=(0, 3), seed=1)
    with pytest.raises(ValueError, match="left padding"):
        check_padded_rows(fresh(qwen3), _policy(), ids, mask.flip(-1), 4)
