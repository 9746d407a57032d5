"""The plugin contracts of kvpolicy (pluggy).

A plugin is any module or object with functions named like these hooks and marked with
``kvpolicy.hookimpl``. Third-party packages expose one through the ``kvpolicy`` entry-point
group; kvpolicy's own stages and policies are registered through exactly the same hooks
(``kvpolicy.builtin``).

Every plugin declares the plugin contract it was written for with ``kvpolicy_contract``; the
registry skips, with a warning, a plugin whose contract is not in ``ACCEPTED_CONTRACTS``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("kvpolicy")
hookimpl = pluggy.HookimplMarker("kvpolicy")

#: The plugin contract this kvpolicy implements: what stages may read (``EvictionInput``), what
#: they return and the hooks below. A contract that only adds to the one before is numbered anew
#: (a plugin using the addition needs a kvpolicy that has it) and keeps admitting the plugins
#: written for the one before (``ACCEPTED_CONTRACTS``): semantic versioning's minor release. A
#: contract that removes or reinterprets something drops the ones before: a major release.
PLUGIN_CONTRACT = 4

#: The contracts whose plugins this kvpolicy loads: 4, and 3 and 2, which 4 and 3 only add to.
ACCEPTED_CONTRACTS = frozenset({2, 3, 4})

#: Every contract so far: the kvpolicy releases implementing it, and what a plugin relies on.
CONTRACTS: dict[int, str] = {
    1: "kvpolicy 0.1.x: stages drew from EvictionInput.generator (a torch.Generator) and read "
    "one layer_seed per stacked layer ([L]) and rows_per_layer",
    2: "kvpolicy 0.2.x: stages draw from counter-based streams (inp.uniform, inp.normal, "
    "inp.head_uniform, inp.head_normal), and inp.layer_seed and inp.row_seed are [B], one per row",
    3: "kvpolicy 0.3 before its release (development versions only): contract 2, plus stages "
    "that keep state across evictions (Stage.state_fields, Stage.update_state, inp.state_of, inp.query_new), the window queries' positions "
    "(inp.query_positions), and facts about the model served (inp.model, a ModelFacts: its shape, "
    "rope(positions), output_projection(layer)), which a stage declares in Stage.needs_model and "
    "checks in Stage.check_model_facts, and allocations that decide the layer budgets from the prompt "
    "(Allocation.from_prompt, Allocation.prompt_budgets); contract 2 plugins load unchanged",
    4: "kvpolicy 0.3.x: contract 3, plus state fields that start at their token's position "
    '(StateField(initial="position"), made by StateField.initial_values), inp.query_new and '
    "inp.query_positions always given (never None: EvictionInput fills their defaults), and state "
    'stored under stable names ("<type_name>.<field>", Policy.state_fields), which are what a '
    "cache stores and a user reads, not what a stage reads: stages read their own fields by their "
    "own names (inp.state_of), and each row's prompt length (inp.prompt_lengths, inp.prompt_mask), "
    "which a stage declares in Stage.needs_prompt, and Reservation.prompt_refusal, so contract 3 "
    "and contract 2 plugins load unchanged",
}


@hookspec
def kvpolicy_contract() -> int:
    """Return the plugin contract this plugin was written for, as an int (now ``4``; ``3`` for a
    plugin whose state fields start at constants, ``2`` for one that keeps no state and reads
    neither query positions nor model facts: they load too).

    Called once per plugin when it is registered, before any other hook of it. A plugin whose
    contract is not in ``ACCEPTED_CONTRACTS`` is skipped (none of its stages or policies registered)
    with a ``PluginLoadWarning`` saying which contract it was built for and which one this
    kvpolicy implements, as is one without this hook: declaring nothing means contract 1, the
    one before declarations existed. Return a literal (``return 2``), never
    ``kvpolicy.PLUGIN_CONTRACT``, which would claim every future contract too.
    """
    raise NotImplementedError  # a specification only: pluggy calls the plugins' implementations


@hookspec
def kvpolicy_stages() -> Sequence[type]:
    """Return the stage classes this plugin provides.

    Called once per plugin when the registry is built. Each class subclasses ``Scorer``,
    ``Reservation`` or ``Selector`` and sets a ``type_name`` unique across plugins; it is then
    usable as ``{type: <type_name>, ...}`` in any policy file. A ``type_name`` already taken by an
    earlier plugin is refused with a warning naming both plugins (built-ins come first).
    """
    raise NotImplementedError  # a specification only: pluggy calls the plugins' implementations


@hookspec
def kvpolicy_policies() -> Mapping[str, Path | str | Mapping[str, Any]]:
    """Return named policies: name -> YAML file path (an ``os.PathLike``, or an
    ``importlib.resources`` ``Traversable`` such as ``files(pkg) / "policies" / "x.yaml"``, which
    holds in a zip too), YAML text or a policy mapping.

    Called once per plugin when the registry is built. The names become loadable with
    ``kvpolicy.load_policy(name)`` and are listed by ``kvpolicy policies``. Policies are validated
    lazily, when loaded, so one broken policy does not hide the others.
    """
    raise NotImplementedError  # a specification only: pluggy calls the plugins' implementations
