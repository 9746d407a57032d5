"""Which policy a vLLM server runs, and which each request runs: the settings, resolved once.

What the integration refuses is ``kvpolicy.vllm.refusals``; how a budget is shared over the
server's KV-cache groups, ``kvpolicy.vllm.budgets``; a resolved policy as the server runs it,
``kvpolicy.vllm.plans``.

Settings come from ``additional_config={"kvpolicy": {...}}`` (``--additional-config`` on
``vllm serve``) or, when that key is absent, from the environment:

* ``KVPOLICY_VLLM_POLICY``: a registered policy name, a policy file or YAML text;
* ``KVPOLICY_VLLM_OVERRIDES``: JSON object of overrides (``{"budget": 128}``);
* ``KVPOLICY_VLLM_TRACE``: a folder where the engine writes eviction and block traces.

In ``additional_config`` the keys are ``policy``, ``overrides`` (a mapping), any override given
directly (``budget``, ``recent``, ``interval``, ``window``, ``count``, ``compress_prompt``,
``seed``), and ``trace``. The front end resolves them once (``resolve``): the policy is loaded and
validated there, and the engine and worker processes receive the resolved YAML, seed included, so
every process and every tensor-parallel rank runs the same policy with the same random streams.
The policy ``none`` switches the plugin on without evicting by default (requests choose).

A request may name its own policy (``resolve_request``) in ``SamplingParams.extra_args`` (the
OpenAI server's ``vllm_xargs``): ``{"kvpolicy": "snapkv", "kvpolicy_budget": 128}`` (flat keys,
as ``vllm_xargs`` takes only strings and numbers), ``{"kvpolicy": {"policy": "snapkv", "budget":
128}}``, or the same object as JSON text; ``"none"`` keeps that request's full cache. Requests
naming nothing run the server's policy. The front end resolves each request's settings before it
reaches the engine, and a bad one fails that request alone.

This module imports nothing from vLLM at import time and nothing from ``kvpolicy.hf``.
"""

from __future__ import annotations

import functools
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import PolicyError
from ..loading import load_policy
from ..policy import Policy
from ..stages.base import DataFile
from .refusals import refuse_unservable
from .support import KVPolicyVLLMError

KEY = "kvpolicy"
ENV_POLICY = "KVPOLICY_VLLM_POLICY"
ENV_OVERRIDES = "KVPOLICY_VLLM_OVERRIDES"
ENV_TRACE = "KVPOLICY_VLLM_TRACE"
_OVERRIDE_KEYS = ("budget", "recent", "interval", "window", "count", "compress_prompt", "seed")
_ALLOWED_KEYS = {"policy", "overrides", "trace", *_OVERRIDE_KEYS}
#: The policy that never evicts: the plugin on, every request's full cache unless it asks otherwise.
NO_POLICY = "none"
#: ``extra_args`` keys of a request: ``kvpolicy`` and flat overrides ``kvpolicy_budget`` etc.
REQUEST_KEY = "kvpolicy"
REQUEST_PREFIX = "kvpolicy_"




@dataclass(frozen=True)
class Resolved:
    """What every engine process needs: the policy as validated YAML (overrides and seed applied);
    ``policy_yaml`` None for the policy ``none`` (no eviction)."""

    policy_yaml: str | None
    source: str
    seed: int
    trace: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"resolved": {"policy_yaml": self.policy_yaml, "source": self.source, "seed": self.seed,
                             "trace": self.trace}}

    @classmethod
    def from_additional_config(cls, additional: Any) -> Resolved | None:
        if not isinstance(additional, dict):
            return None
        entry = additional.get(KEY)
        if not isinstance(entry, dict) or "resolved" not in entry:
            return None
        r = entry["resolved"]
        return cls(r["policy_yaml"], r["source"], int(r["seed"]), r.get("trace"))

    def policy(self) -> Policy | None:
        """The policy, loaded once per process (``loaded``)."""
        return None if self.policy_yaml is None else loaded(self.policy_yaml, self.seed)


#: How many distinct policies a process keeps what it derived from them for (``loaded``, ``PerPolicy``).
POLICIES_KEPT = 64

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PerPolicy(OrderedDict[K, V]):
    """What a process derives once per distinct policy (a plan, a schedule, a refusal), kept for
    the ``size`` policies used last: clients may send any number of distinct policies, and a
    server that runs for months must not keep them all. A request keeps what it was given, so
    dropping an entry only means deriving it again for the next request that names it."""

    def __init__(self, size: int = POLICIES_KEPT) -> None:
        super().__init__()
        self.size = size

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


@functools.lru_cache(maxsize=POLICIES_KEPT)
def loaded(policy_yaml: str, seed: int) -> Policy:
    """A resolved policy's YAML loaded, once per process and distinct policy: the front end, the
    scheduler and every KV-cache group of a worker share it (a ``Policy`` is not changed once
    loaded). A server of a group per layer would otherwise load it once per layer at its first step."""
    return load_policy(policy_yaml, seed=seed)


def requested(additional: Any) -> dict[str, Any] | None:
    """The user's kvpolicy settings (``additional_config`` first, then the environment), or None
    when kvpolicy is not switched on for this server."""
    if isinstance(additional, dict) and KEY in additional:
        entry = additional[KEY]
        if isinstance(entry, str):
            entry = {"policy": entry}
        if not isinstance(entry, dict):
            raise KVPolicyVLLMError(
                f'additional_config["{KEY}"] must be a mapping such as {{"policy": "snapkv", "budget": 128}}, '
                f"got {type(entry).__name__}"
            )
        return dict(entry)
    name = os.environ.get(ENV_POLICY)
    if not name:
        return None
    entry = {"policy": name}
    raw = os.environ.get(ENV_OVERRIDES)
    if raw:
        try:
            overrides = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise KVPolicyVLLMError(f"{ENV_OVERRIDES} is not valid JSON ({exc}): {raw!r}") from None
        if not isinstance(overrides, dict):
            raise KVPolicyVLLMError(f"{ENV_OVERRIDES} must be a JSON object, got {raw!r}")
        entry["overrides"] = overrides
    if os.environ.get(ENV_TRACE):
        entry["trace"] = os.environ[ENV_TRACE]
    return entry


def resolve(entry: dict[str, Any], *, per_request: bool = False) -> Resolved:
    """Load and validate the requested policy: every error names what is wrong.

    ``per_request``: settings a client sent with one request: no ``trace``, and no policy file
    (a client must not make the server read its files); names, YAML text and mappings only.
    """
    if "resolved" in entry and not per_request:  # already resolved by a front end (a config passed through twice)
        r = Resolved.from_additional_config({KEY: entry})
        assert r is not None
        return r
    allowed = _ALLOWED_KEYS - {"trace"} if per_request else _ALLOWED_KEYS
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise KVPolicyVLLMError(f"unknown setting(s) {unknown}; allowed: {sorted(allowed)}")
    source = entry.get("policy")
    if not (isinstance(source, str) and source) and not (per_request and isinstance(source, dict)):
        raise KVPolicyVLLMError('no policy given: set {"policy": NAME_OR_FILE} (or KVPOLICY_VLLM_POLICY)')
    if not isinstance(entry.get("overrides") or {}, dict):
        raise KVPolicyVLLMError(f'"overrides" must be a mapping, got {entry["overrides"]!r}')
    overrides = dict(entry.get("overrides") or {})
    overrides.update({k: entry[k] for k in _OVERRIDE_KEYS if k in entry})
    trace = entry.get("trace")
    trace = str(trace) if trace else None
    if source == NO_POLICY:
        if overrides:
            raise KVPolicyVLLMError(f"policy {NO_POLICY!r} (no eviction) takes no overrides, got {sorted(overrides)}")
        return Resolved(None, NO_POLICY, 0, trace)
    label = source if isinstance(source, str) else "<mapping>"
    if per_request and isinstance(source, str) and _is_file(source):
        raise KVPolicyVLLMError(
            f"policy {label!r}: a request may name a registered policy or send one as YAML text or a mapping, "
            "not a file of the server"
        )
    try:
        with DataFile.builtin_only() if per_request else nullcontext():
            policy = load_policy(source, **overrides)
    except PolicyError as exc:
        raise KVPolicyVLLMError(f"policy {label!r} does not load:\n{exc}") from None
    except (TypeError, ValueError) as exc:  # an override of the wrong kind (a list for a budget, ...)
        raise KVPolicyVLLMError(f"policy {label!r}: invalid override: {exc}") from None
    if per_request:
        refuse_server_files(policy, label)
    refuse_unservable(policy)
    seed = policy.resolve_seed()  # a `seed: null` policy draws once here: every rank shares it
    return Resolved(policy.with_overrides(seed=seed).to_yaml(), label, seed, trace)


def _is_file(source: str) -> bool:
    from pathlib import Path

    try:
        return Path(source).is_file()
    except (OSError, ValueError):
        return False


def refuse_server_files(policy: Policy, label: str) -> None:
    """A request's policy may read kvpolicy's built-in data files only (``builtin:NAME``): a path in
    a stage field (a calibration, a head profile) would make the server read a file a client named."""
    named = [f"{stage.kind} {stage.type_name!r} {field}: {value!r}" for stage, field, value in policy.data_files
             if not DataFile.is_builtin(value)]
    if named:
        raise KVPolicyVLLMError(
            f"policy {label!r} names a file of the server ({'; '.join(named)}): a request may use kvpolicy's "
            "built-in files only (builtin:NAME); a server names its own files in its policy (--additional-config)"
        )


def request_entry(extra_args: Any) -> dict[str, Any] | None:
    """The kvpolicy settings a request sent in ``extra_args``, as a ``resolve`` entry; None when it
    sent none. ``kvpolicy`` is a name or YAML text, JSON text of a settings object, or a mapping;
    ``kvpolicy_<override>`` keys add overrides."""
    if not isinstance(extra_args, dict):
        return None
    flat = {k[len(REQUEST_PREFIX):]: v for k, v in extra_args.items() if k.startswith(REQUEST_PREFIX)}
    if REQUEST_KEY not in extra_args:
        if flat:
            raise KVPolicyVLLMError(
                f"{sorted(REQUEST_PREFIX + k for k in flat)} given without {REQUEST_KEY!r}: name the policy too "
                f'(e.g. {{"{REQUEST_KEY}": "snapkv", "{REQUEST_PREFIX}budget": 128}})'
            )
        return None
    value = extra_args[REQUEST_KEY]
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None  # YAML flow text of a policy, not a settings object
        if isinstance(parsed, dict) and "policy" in parsed:
            value = parsed
    if isinstance(value, str):
        entry: dict[str, Any] = {"policy": value}
    elif isinstance(value, dict):
        entry = dict(value)
    else:
        raise KVPolicyVLLMError(
            f"{REQUEST_KEY!r} must be a policy name, YAML text or a settings mapping, got {type(value).__name__}"
        )
    clash = sorted(set(flat) & set(entry))
    if clash:
        raise KVPolicyVLLMError(f"{clash} given twice (in {REQUEST_KEY!r} and as {REQUEST_PREFIX}<key>)")
    entry.update(flat)
    return entry


def resolve_request(extra_args: Any) -> dict[str, Any] | None:
    """A request's ``extra_args`` with its kvpolicy settings resolved (the form engine processes
    read: ``request_policy``), or None when it sent none. Raises ``KVPolicyVLLMError`` for a bad one."""
    try:
        entry = request_entry(extra_args)
        if entry is None:
            return None
        resolved = resolve(entry, per_request=True)
    except KVPolicyVLLMError as exc:
        raise KVPolicyVLLMError(f"this request's kvpolicy settings: {str(exc).removeprefix('kvpolicy[vllm]: ')}") from None
    assert isinstance(extra_args, dict)  # request_entry returned an entry
    rest = {k: v for k, v in extra_args.items() if k != REQUEST_KEY and not k.startswith(REQUEST_PREFIX)}
    return {**rest, REQUEST_KEY: resolved.to_dict()}


def request_policy(extra_args: Any, server: Resolved) -> Resolved:
    """The policy a request runs, in an engine process: its own as the front end resolved it, else
    the server's."""
    if not isinstance(extra_args, dict) or REQUEST_KEY not in extra_args:
        return server
    r = Resolved.from_additional_config({KEY: extra_args[REQUEST_KEY]})
    if r is None:
        raise KVPolicyVLLMError(
            f"a request reached the engine with kvpolicy settings the front end did not resolve "
            f"({extra_args[REQUEST_KEY]!r}): add requests through vLLM's input processor (LLM.generate, "
            "LLMEngine.add_request with a prompt, the OpenAI server), which validates and resolves them; "
            "this request is refused"
        )
    return r


