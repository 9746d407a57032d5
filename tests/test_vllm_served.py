"""Every policy walked into the vLLM integration: served, or refused by name with its reason, at
start-up and per request, and ``docs/vllm.md``'s table says which (pure settings, no vLLM)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvpolicy
from kvpolicy.vllm.settings import KVPolicyVLLMError, resolve

#: The policies vLLM does not serve yet (both example plugins installed), each with the words its
#: refusal gives as the reason: the short documented list (docs/vllm.md, "Every policy, served or
#: not"). Serving one of them means removing it here and in that table.
NOT_SERVED: dict[str, str] = {}
TABLE = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


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
    assert set(refused) == set(NOT_SERVED), "a refusal outside the documented list, or a listed policy now served"
    for name, why in refused.items():
        assert f"policy {name!r}" in why and NOT_SERVED[name] in why, why


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
    assert {n for n, s in rows.items() if s == "not served"} == set(NOT_SERVED)
