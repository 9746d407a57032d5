"""Every policy walked into the vLLM integration: served, or refused by name with its reason, at
start-up and per request, and ``docs/vllm.md``'s table says which (pure settings, no vLLM)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvpolicy
from kvpolicy.vllm.settings import KVPolicyVLLMError, resolve

#: The policies vLLM does not serve yet (both example plugins installed), each with the words its
#: refusal gives as the reason: the short documented list (docs/vllm.md, "Every policy, served or
#: not"). Serving one of them means removing it here and in that table.
NOT_SERVED: dict[str, str] = {}
#: What a two-tier policy's refusal says (any policy with a ``recall`` block, built-in or not: not
#: served yet, docs/vllm.md "Two tiers in vLLM (not served yet)").
TWO_TIERS = "has a `recall` block"
TABLE = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def not_served() -> dict[str, str]:
    """``NOT_SERVED`` and every registered two-tier policy, each with the words of its refusal."""
    two_tier = {name: TWO_TIERS for name in kvpolicy.available_policies()
                if kvpolicy.load_policy(name).config.recall is not None}
    return {**NOT_SERVED, **two_tier}


def refusal(name: str, *, per_request: bool) -> str | None:
    try:
        resolve({"policy": name}, per_request=per_request)
    except KVPolicyVLLMError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("per_request", [False, True], ids=["server", "request"])
def test_every_policy_is_served_or_refused_by_name_with_its_reason(per_request):
    refused = {}
    for name in kvpolicy.available_policies():
        why = refusal(name, per_request=per_request)
        if why is not None:
            refused[name] = why
    expected = not_served()
    assert set(refused) == set(expected), "a refusal outside the documented list, or a listed policy now served"
    for name, why in refused.items():
        assert f"policy {name!r}" in why and expected[name] in why, why


@pytest.mark.parametrize("name", ["snapkv@select", "vase-attnv@select", "streamingllm@select"])
def test_select_mode_variants_are_served(name):
    assert refusal(name, per_request=True) is None and refusal(name, per_request=False) is None


@pytest.mark.parametrize("name,why", [("h2o@select", "keep state"),
                                      ("ada-snapkv@select", "select mode with a count per head")])
def test_select_mode_variants_vllm_cannot_serve_are_refused_by_name(name, why):
    got = refusal(name, per_request=True)
    assert got is not None and f"policy {name!r}" in got and why in got


def test_the_docs_table_lists_every_policy_as_served_or_not():
    text = TABLE.read_text()
    section = text[text.index("### Every policy, served or not"):]
    rows = dict(re.findall(r"^\| `([\w@.-]+)` \| (served|not served)", section, flags=re.M))
    assert set(rows) == set(kvpolicy.available_policies())
    assert {n for n, s in rows.items() if s == "not served"} == set(not_served())
    assert "## Two tiers in vLLM (not served yet)" in text  # the design the two-tier refusals point to


TWO_TIER_SPEC = {
    "name": "snapkv-two-tier", "seed": 0, "schedule": {"budget": 96, "recent": 32, "interval": 16, "window": 16},
    "scorer": {"type": "attention", "pooling": "avg", "kernel": 5}, "selector": {"type": "greedy"},
    "recall": {"budget": 32, "page_size": 16, "interval": 1, "scorer": {"type": "quest"}},
}


def test_a_two_tier_policy_is_refused_by_name_at_start_up_per_request_and_in_a_worker(tmp_path):
    """A ``recall`` block is not served yet: refused at start-up (the server's policy file), per
    request (its own mapping, HTTP 400) and by a worker's check (never served as its eviction
    alone), naming ``recall`` and what to use instead; the same policy without it is served."""
    import yaml

    from kvpolicy.vllm.paged_cache import PagedCache
    from kvpolicy.vllm.refusals import recall_refusal
    from kvpolicy.vllm.settings import resolve_request

    server_file = tmp_path / "two-tier.yaml"
    server_file.write_text(yaml.safe_dump(TWO_TIER_SPEC))
    with pytest.raises(KVPolicyVLLMError) as at_start:
        resolve({"policy": str(server_file)})
    with pytest.raises(KVPolicyVLLMError, match="this request's kvpolicy settings") as per_request:
        resolve_request({"kvpolicy": {"policy": TWO_TIER_SPEC}})
    for why in (str(at_start.value), str(per_request.value)):
        assert "policy 'snapkv-two-tier' has a `recall` block" in why, why
        assert "vLLM does not serve yet" in why and "EvictingCache" in why and "generate()" in why
        assert "Two tiers in vLLM (not served yet)" in why
    policy = kvpolicy.load_policy(TWO_TIER_SPEC)
    rank = SimpleNamespace(per_head_refusal=None, model_facts=None, head_dim=64, kv_heads=3, head_offset=0, q_heads=9)
    with pytest.raises(KVPolicyVLLMError, match="has a `recall` block"):
        PagedCache.check_policy(rank, policy)  # the worker's own check
    evicting = {k: v for k, v in TWO_TIER_SPEC.items() if k != "recall"}
    assert recall_refusal(kvpolicy.load_policy(evicting)) is None and recall_refusal(None) is None
    assert resolve_request({"kvpolicy": {"policy": evicting}}) is not None
