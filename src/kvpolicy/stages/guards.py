"""Run-time guards around every stage call: ``Policy.select`` keeps its promises or says why not.

``select`` promises ``[B, Hkv, K]`` ascending, duplicate-free slot indices that contain every
protected slot. Stages are third-party code (plugins) fed whatever tensors the caller passes, so
each stage call goes through one of the functions below. A stage that breaks its contract (a
``[B, N]`` result that torch would silently broadcast, a reservation that protects more than the
budget keeps) or inputs that no float32 score can rank (NaN, inf) raise a ``SelectionError``
naming the input or the stage at fault, instead of a silently wrong selection (a dropped recent
buffer) or a bare torch error. Each check costs at most one host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .base import Reservation
from .errors import SelectionError

if TYPE_CHECKING:
    from .base import Allocation, EvictionInput, Merge, Scorer, Selector, Stage
    from .recall import RecallInput

#: Largest finite float32: scores and priorities are float32, and protected slots rank at +inf,
#: strictly above every candidate's priority (clamped to this).
F32_MAX = torch.finfo(torch.float32).max



def check_inputs(inp: EvictionInput) -> None:
    """Refuse keys, values or queries holding NaN or inf, or float64 entries beyond float32's range;
    and a recent buffer larger than the budget. One synchronisation.

    Why: scores are computed in float32, and a NaN or inf input gives NaN or inf scores, which
    cannot be ranked (an inf score would tie with the priority of protected slots). Every entry
    is checked, padding slots and empty window entries included: scorers read them too (a
    padding key times a zero weight is still NaN).
    """
    check_recent(inp)
    named = _read_inputs(inp)
    ok = torch.stack([_all_representable(t) for _, t in named]).tolist()
    for (label, t), good in zip(named, ok, strict=True):
        if not good:
            raise SelectionError(_bad_input_message(label, t))


def _read_inputs(inp: EvictionInput) -> list[tuple[str, torch.Tensor]]:
    """The keys, values and queries, by name, less values on the ``meta`` device (a placeholder
    where no stage reads them: ``Policy.reads_values``; keys and queries are always real)."""
    values = [] if inp.values.is_meta else [("values", inp.values)]
    return [("keys", inp.keys), *values, ("queries", inp.queries)]


def check_recent(inp: EvictionInput) -> None:
    """Refuse a recent buffer larger than the budget (host arithmetic only, no synchronisation)."""
    recent = inp.num_slots - inp.num_candidates
    if recent > inp.budget:
        raise SelectionError(
            f"the recent buffer ({recent} slots: N={inp.num_slots} - num_candidates={inp.num_candidates}) "
            f"is larger than the budget ({inp.budget} slots kept): it cannot be kept whole"
        )


def check_appended(
    layer: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
    token_valid: torch.Tensor | None, window: int,
) -> None:
    """Select mode: refuse a step's keys or values (``[B, Hkv, T, D]``, its real tokens:
    ``token_valid [B, T]``) or the queries it stores in the window (``[B, Hq, T, D]``, the last
    ``window``, padding included: scorers read every window entry) that hold NaN or inf, or
    float64 entries beyond float32's range. One synchronisation.

    Why here: a select-mode cache keeps every token and chooses among them at every step, so
    checking the whole cache at each choice (as an eviction does) would cost more than the
    choice. Each token is checked once, as it enters, before the cache changes: an error
    leaves the cache as it was. Padding tokens are never stored, so only real ones are checked.
    """
    named = [("keys", keys), ("values", values)]
    if token_valid is not None and not bool(token_valid.all()):
        pad = ~token_valid.to(keys.device)[:, None, :, None]
        named = [(label, t.masked_fill(pad, 0.0)) for label, t in named]
    if queries is not None and window > 0:
        kept = min(window, queries.shape[2])
        named.append((f"queries (the last {kept} of the step, which the window keeps)", queries[:, :, -kept:]))
    ok = torch.stack([_all_representable(t) for _, t in named]).tolist()
    for (label, t), good in zip(named, ok, strict=True):
        if not good:
            raise SelectionError(
                f"layer {layer}: a select-mode step is refused before it enters the cache (the cache is "
                "unchanged): " + _bad_input_message(
                    label, t, layout="[row, head, token, channel] =",
                    why="selection scores every token it keeps, and NaN or inf scores cannot be ranked",
                )
            )


def check_query_window(readers: list[str], inp: EvictionInput) -> None:
    """Refuse an empty query window (``W = 0``) when some stage reads the queries.

    ``readers`` names those stages (``PolicyConfig.query_readers``). Load already refuses
    ``schedule.window = 0`` for them; this catches ``select`` called with ``[B, Hq, 0, D]``
    queries, which such a stage cannot score (there is no newest query to read).
    """
    if readers and inp.queries.shape[2] == 0:
        raise SelectionError(
            f"queries hold no window entry (shape {tuple(inp.queries.shape)}, W = 0), but "
            f"{' and '.join(readers)} {'reads' if len(readers) == 1 else 'read'} them: pass the window of "
            "recent queries (W >= 1; query_valid=False marks entries that hold no query yet)"
        )


def run_scorer(scorer: Scorer, inp: EvictionInput, *, where: str = "") -> torch.Tensor:
    """``scorer.score(inp)`` as checked ``[B, Hkv, N]`` float32 scores. One synchronisation.

    Refuses (``SelectionError`` naming the scorer, and ``where`` it runs, e.g. ``" (in
    reservation 'top_scores')"``) a result that is not a floating ``[B, Hkv, N]`` tensor on the
    inputs' device, and scores that are NaN or inf on a valid candidate slot (the only entries
    read): those could not be ranked. If the inputs themselves are not finite, the error names
    them instead; if they are finite, it says that the scores overflowed and how to avoid it.
    """
    name = f"scorer {scorer.type_name!r}{where}"
    scores = scorer.score(inp)
    _check_output(name, "scores", scores, inp, want_bool=False)
    scores = scores.float()
    bad = ~torch.isfinite(scores) & inp.candidate_mask
    if bool(bad.any()):
        check_inputs(inp)  # the error path only: name the inputs if they are at fault
        raise SelectionError(_non_finite_scores_message(name, bad, inp))
    return scores


def run_packed_scorer(scorer: Scorer, inp: EvictionInput) -> torch.Tensor | None:
    """``scorer.score_packed(inp)``, checked as ``run_scorer`` checks ``score``: None (the
    scorer declines this input), or ``[B, Hkv, N]`` float32 scores, finite on the candidates
    ``[0, C)`` (every slot of a packed row is valid). One synchronisation.

    Refuses (``SelectionError`` naming the scorer) a result that is not a floating
    ``[B, Hkv, N]`` tensor on the inputs' device. Non-finite scores on a candidate are refused
    with ``run_scorer``'s error, by running ``score`` (the error path only): an overflow is
    reported as ``select`` reports it; if ``score`` gives finite scores there, the two methods
    disagree, and the error says so. That the scores equal ``score``'s is the scorer's promise
    (``Scorer.score_packed``), for its tests to hold it to.
    """
    name = f"scorer {scorer.type_name!r}"
    scores = scorer.score_packed(inp)
    if scores is None:
        return None
    _check_output(f"{name} score_packed", "scores", scores, inp, want_bool=False)
    c = inp.num_candidates
    if not bool(_all_representable(scores[..., :c])):  # one pass, no temporary of C entries
        run_scorer(scorer, inp)  # raises, naming the scorer, as select would
        bad = ~torch.isfinite(scores[..., :c].float())
        raise SelectionError(
            f"{name} score_packed produced non-finite scores (NaN or inf) for {int(bad.sum())} candidate slot(s), "
            f"the first at [row, head, slot] = {bad.nonzero()[0].tolist()}, where score gives finite ones: "
            "score_packed must give score's scores on every candidate"
        )
    return scores.float()


def run_page_scorer(scorer: Scorer, inp: EvictionInput, page_size: int) -> torch.Tensor:
    """``scorer.score_pages(inp)`` as checked ``[B, Hkv, C // P]`` float32 page scores (select
    mode's page choice, ``Scorer.choice_page_size``). One synchronisation.

    Refuses (``SelectionError`` naming the scorer) a result that is not a floating tensor of
    that shape on the inputs' device, or that holds NaN or inf (every page is a candidate)."""
    name = f"scorer {scorer.type_name!r} score_pages"
    expected = (inp.batch, inp.num_kv_heads, inp.num_candidates // page_size)
    scores = scorer.score_pages(inp)
    if not isinstance(scores, torch.Tensor):
        raise SelectionError(f"{name} returned {type(scores).__name__}, expected a [B, Hkv, C // P] = {expected} tensor")
    if tuple(scores.shape) != expected:
        raise SelectionError(
            f"{name} returned page scores of shape {tuple(scores.shape)}, expected [B, Hkv, C // P] = {expected} "
            f"(one score per row, KV head and whole candidate page of {page_size} slots)"
        )
    if not scores.is_floating_point():
        raise SelectionError(f"{name} returned page scores of dtype {scores.dtype}, expected a floating dtype (float32)")
    if scores.device != inp.keys.device:
        raise SelectionError(f"{name} returned page scores on {scores.device}, expected the inputs' device {inp.keys.device}")
    if scores.numel() and not bool(_all_representable(scores)):
        bad = ~torch.isfinite(scores.float())
        raise SelectionError(
            f"{name} produced non-finite page scores (NaN or inf) for {int(bad.sum())} page(s), the first at "
            f"[row, head, page] = {bad.nonzero()[0].tolist()}: float32 overflowed (the inputs were checked "
            "finite as they entered the cache)"
        )
    return scores.float()


def run_recall_scorer(scorer: Scorer, inp: RecallInput) -> torch.Tensor:
    """``scorer.score_summaries(inp)`` as checked ``[B, Hkv, Np]`` float32 page scores (a
    two-tier policy's recall), ``-inf`` on empty page slots. One synchronisation.

    Refuses (``SelectionError`` naming the scorer) a result that is not a floating tensor of
    that shape on the queries' device, or that holds NaN or inf on a page that holds one."""
    name = f"recall scorer {scorer.type_name!r} score_summaries"
    expected = tuple(inp.page_valid.shape)
    scores = scorer.score_summaries(inp)
    if not isinstance(scores, torch.Tensor):
        raise SelectionError(f"{name} returned {type(scores).__name__}, expected a [B, Hkv, Np] = {expected} tensor")
    if tuple(scores.shape) != expected:
        raise SelectionError(
            f"{name} returned page scores of shape {tuple(scores.shape)}, expected [B, Hkv, Np] = {expected} "
            "(one score per row, KV head and slow-tier page slot)"
        )
    if not scores.is_floating_point():
        raise SelectionError(f"{name} returned page scores of dtype {scores.dtype}, expected a floating dtype (float32)")
    if scores.device != inp.queries.device:
        raise SelectionError(f"{name} returned page scores on {scores.device}, expected the queries' device {inp.queries.device}")
    empty = ~inp.page_valid
    scores = scores.float().masked_fill(empty, float("-inf"))
    if not bool(torch.isfinite(scores).logical_or_(empty).all()):
        bad = ~torch.isfinite(scores) & inp.page_valid
        raise SelectionError(
            f"{name} produced non-finite page scores (NaN or inf) for {int(bad.sum())} page(s), the first at "
            f"[row, head, page] = {bad.nonzero()[0].tolist()}: float32 overflowed (the inputs were checked "
            "finite as they entered the cache)"
        )
    return scores


def run_state_update(stage: Stage, inp: EvictionInput) -> dict[str, torch.Tensor]:
    """``stage.update_state(inp)``, checked: every declared field, nothing else, each of the
    shape, dtype and device its current value has (``[B, Hkv, N]`` per slot, ``[B, Hkv]`` per
    head), finite wherever it is read (valid slots; every head). One synchronisation.

    Refuses (``SelectionError`` naming the stage and the field) anything else: the caller stores
    nothing, so the cache is left as it was.
    """
    name = f"{stage.kind} {stage.type_name!r}"
    declared = stage.state_fields
    old = inp.state_of(stage)
    new = stage.update_state(inp)
    if not isinstance(new, Mapping):
        raise SelectionError(f"{name} update_state returned {type(new).__name__}, expected a mapping of its state fields")
    missing, extra = sorted(set(declared) - set(new)), sorted(set(new) - set(declared))
    if missing or extra:
        raise SelectionError(
            f"{name} update_state returned fields {sorted(new)}, expected exactly its state_fields {sorted(declared)}"
            + (f" (missing {missing})" if missing else "") + (f" (undeclared {extra})" if extra else "")
        )
    out: dict[str, torch.Tensor] = {}
    bad_any = []
    for field, spec in declared.items():
        t, before = new[field], old[field]
        where = f"{name} state field {field!r}"
        if not isinstance(t, torch.Tensor):
            raise SelectionError(f"{where} is {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != tuple(before.shape):
            shape = "[B, Hkv, N]" if spec.per == "slot" else "[B, Hkv]"
            raise SelectionError(f"{where} has shape {tuple(t.shape)}, expected {shape} = {tuple(before.shape)}")
        if t.dtype != spec.dtype:
            raise SelectionError(f"{where} has dtype {t.dtype}, expected its declared {spec.dtype}")
        if t.device != before.device:
            raise SelectionError(f"{where} is on {t.device}, expected the inputs' device {before.device}")
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if spec.per == "slot":
                bad &= inp.slot_valid
            bad_any.append((field, bad))
        out[field] = t
    if bad_any and bool(torch.stack([b.any() for _, b in bad_any]).any()):
        field, bad = next((f, b) for f, b in bad_any if bool(b.any()))
        # The inputs were refused first if not finite (Policy.observe), so this is the update's own
        # arithmetic: say so, as a scorer's non-finite scores do.
        largest = max(float(t.detach().abs().max()) if t.numel() else 0.0 for _, t in _read_inputs(inp))
        raise SelectionError(
            f"{name} state field {field!r} holds {int(bad.sum())} non-finite values (NaN or inf), the first at "
            f"index {bad.nonzero()[0].tolist()}, from finite inputs (entries up to {largest:.3g}): the update "
            "overflowed float32 or divided 0 by 0; state must stay finite; the cache keeps the state it had"
        )
    return out


def _non_finite_scores_message(name: str, bad: torch.Tensor, inp: EvictionInput) -> str:
    """Why finite inputs gave NaN or inf scores: a float32 overflow when a dot product of the
    inputs can exceed float32's range (``|x|^2 * D``), else an overflow or 0/0 in the scorer."""
    inputs = [t for _, t in _read_inputs(inp)]
    dtypes = "/".join(dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in inputs))
    largest = max(float(t.abs().max()) if t.numel() else 0.0 for t in inputs)
    dot = largest * largest * inp.head_dim  # the largest |q . k| (or ||k||^2) the inputs allow
    head = (f"{name} produced non-finite scores (NaN or inf) for {int(bad.sum())} valid candidate slot(s), "
            f"the first at [row, head, slot] = {bad.nonzero()[0].tolist()}")
    if dot > F32_MAX:
        return (
            f"{head}: the scores overflowed float32 from finite inputs. The inputs are {dtypes} and finite, "
            f"but their entries reach {largest:.3g}, so a dot product of two of them (up to |x|^2 * D = "
            f"{dot:.3g} with D = {inp.head_dim}) exceeds float32's largest value, {F32_MAX:.3g}. Rescale "
            "the keys, values and queries (divide them by a common factor) so that |x|^2 * D stays far "
            "below it; scores are always computed in float32, so a wider dtype does not help"
        )
    return (
        f"{head}, from finite inputs ({dtypes}, entries up to {largest:.3g}): the scorer's arithmetic most "
        f"likely overflowed (float32 ends at {F32_MAX:.3g}, float16 at 65504; a product of several "
        "entries grows fast) or computed 0/0 or inf - inf. Rescale the inputs to smaller magnitudes, or "
        "make the scorer compute in float32 within its range"
    )


def run_reservation(reservation: Reservation, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
    """``protected | reservation.reserve(inp, protected)``, checked. One synchronisation.

    Refuses (``SelectionError`` naming the reservation) a mask that is not ``[B, Hkv, N]`` bool
    on the inputs' device; one that adds more candidate slots in some row and head than the
    stage declares with ``reserved_count(budget)`` (the bound ``load_policy`` checked against
    the budget); and one that leaves more slots protected in some row and head than the budget
    keeps, which would drop protected slots.
    """
    name = f"reservation {reservation.type_name!r}"
    mask = reservation.reserve(inp, protected)
    _check_output(name, "a protection mask", mask, inp, want_bool=True)
    result = protected | mask
    if result.numel() == 0:
        return result
    in_candidates = torch.arange(inp.num_slots, device=mask.device) < inp.num_candidates
    added = (mask & ~protected & in_candidates).sum(-1)
    total = result.sum(-1)
    added_max, total_max = torch.stack([added.max(), total.max()]).tolist()
    declared = declared_count(reservation, inp.budget)
    if declared is not None and added_max > declared:
        raise SelectionError(
            f"{name} protects {added_max} more candidate slots in some row/head but declares at most "
            f"reserved_count({inp.budget}) = {declared}: load_policy checks recent + reserved <= budget "
            "with that bound, so the stage must keep to it (or declare a larger one)"
        )
    if total_max > inp.budget:
        before = int(protected.sum(-1).max())
        raise SelectionError(
            f"{name} protects {total_max} slots in some row/head but the budget keeps {inp.budget}: "
            f"up to {before} were protected before it (recent buffer {inp.num_slots - inp.num_candidates}, "
            f"earlier reservations) and it adds up to {added_max}, so protected slots would be dropped. "
            "A reservation must protect a bounded number of slots; declare the bound with "
            "reserved_count(budget) so that load_policy checks it"
        )
    return result


def run_selector(
    selector: Selector, scores: torch.Tensor | None, inp: EvictionInput, eligible: torch.Tensor
) -> torch.Tensor:
    """``selector.priority(scores, inp)`` as checked ``[B, Hkv, N]`` float32 priorities. One synchronisation.

    Refuses (``SelectionError`` naming the selector) a result that is not a floating
    ``[B, Hkv, N]`` tensor on the inputs' device, and NaN on an ``eligible`` slot (NaN cannot be
    ranked). Infinite priorities are allowed: the caller clamps them below protected slots.
    """
    name = f"selector {selector.type_name!r}"
    priority = selector.priority(scores, inp)
    _check_output(name, "priorities", priority, inp, want_bool=False)
    priority = priority.float()
    nan = torch.isnan(priority) & eligible
    if bool(nan.any()):
        raise SelectionError(
            f"{name} produced NaN priorities for {int(nan.sum())} eligible candidate slot(s), the first "
            f"at [row, head, slot] = {nan.nonzero()[0].tolist()}"
            + (", from finite scores" if scores is not None else "")
        )
    return priority


def _check_counts_tensor(name: str, counts: object, priority: torch.Tensor, inp: EvictionInput) -> None:
    """Refuse per-head counts that are not ``[B, Hkv]`` long on the inputs' device."""
    want = (inp.batch, inp.num_kv_heads)
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != want or counts.dtype != torch.long:
        got = f"{tuple(counts.shape)} {counts.dtype}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise SelectionError(f"{name} must return [B, Hkv] = {list(want)} long counts, got {got}")
    if counts.device != priority.device:
        raise SelectionError(f"{name} returned counts on {counts.device}, the inputs are on {priority.device}")


def run_allocation(
    allocation: Allocation, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput
) -> torch.Tensor:
    """``allocation.head_counts(...)`` as checked ``[B, Hkv]`` long counts. One synchronisation.

    Refuses (``SelectionError`` naming the allocation) a result of another shape, dtype or
    device, a head given fewer slots than it protects or more than it holds, and a row whose
    counts do not add up to ``Hkv * budget`` (or to every slot it holds, when it holds fewer).
    """
    name = f"allocation {allocation.type_name!r}"
    counts = allocation.head_counts(priority, protected, inp)
    _check_counts_tensor(name, counts, priority, inp)
    held = (priority > float("-inf")).sum(-1)
    floor = protected.sum(-1)
    total = torch.minimum(held.sum(-1), torch.tensor(inp.num_kv_heads * inp.budget, device=held.device))
    bad = (counts < floor) | (counts > held)
    if bool(bad.any()) or bool((counts.sum(-1) != total).any()):
        if bool(bad.any()):
            r, h = bad.nonzero()[0].tolist()
            problem = (f"gave row {r}, head {h} {int(counts[r, h])} slots, outside [{int(floor[r, h])} protected, "
                       f"{int(held[r, h])} held]")
        else:
            r = int((counts.sum(-1) != total).nonzero()[0])
            problem = f"gave row {r} {int(counts[r].sum())} slots in all where {int(total[r])} are due"
        raise SelectionError(f"{name} {problem}")
    return counts


def run_selector_counts(
    selector: Selector, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput
) -> torch.Tensor:
    """``selector.head_counts(...)`` (a ``sets_counts`` selector) as checked ``[B, Hkv]`` long
    counts. One synchronisation.

    Refuses (``SelectionError`` naming the selector) a result of another shape, dtype or device,
    and a head given fewer slots than it protects or more than ``min(inp.budget, its valid
    slots)``: the budget is the pool each head's slots are sized by. The counts need not add up
    to anything (a threshold keeps what passes)."""
    name = f"selector {selector.type_name!r}"
    counts = selector.head_counts(priority, protected, inp)
    _check_counts_tensor(name, counts, priority, inp)
    held = (priority > float("-inf")).sum(-1).clamp(max=inp.budget)
    floor = protected.sum(-1)
    bad = (counts < floor) | (counts > held)
    if bool(bad.any()):
        r, h = bad.nonzero()[0].tolist()
        raise SelectionError(
            f"{name} gave row {r}, head {h} {int(counts[r, h])} slots, outside [{int(floor[r, h])} protected, "
            f"{int(held[r, h])} held within the budget]"
        )
    return counts


def declared_count(reservation: Reservation, budget: int) -> int | None:
    """The stage's ``reserved_count(budget)``, or None when it does not override the default.

    Why None: the base method returns 0 so that ``load_policy`` can still add up the declared
    counts, but a stage that declares nothing only promises to stay within the budget, which is
    checked at run time; holding it to 0 would refuse every slot it protects.
    """
    if type(reservation).reserved_count is Reservation.reserved_count:
        return None
    return reservation.reserved_count(budget)


def _all_representable(t: torch.Tensor) -> torch.Tensor:
    """0-d bool: every entry of ``t`` is finite, and within float32's range for float64 (scores are
    computed in float32). One pass with no temporary as large as ``t`` (the sum of a float32 CPU
    tensor; else the minimum and maximum; NaN propagates through each): cheap enough to run on the
    whole cache at every step of select mode."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.dtype == torch.float32 and t.device.type == "cpu":
        # A finite sum has no NaN or inf among its terms (either would make it one), and one
        # reduction is half the work of two; an overflowing sum of finite terms falls through.
        # (On CPU only: the test of the sum would synchronise a GPU.)
        finite = torch.isfinite(t.sum())
        if bool(finite):
            return finite
    lo, hi = torch.aminmax(t)
    if t.dtype == torch.float64:
        return (lo >= -F32_MAX) & (hi <= F32_MAX)  # False for NaN
    return torch.isfinite(lo) & torch.isfinite(hi)


_WHY_FINITE = (
    "eviction needs finite keys, values and queries (padding slots and empty window entries included), "
    "since NaN or inf scores cannot be ranked"
)


def _bad_input_message(label: str, t: torch.Tensor, layout: str = "index", why: str = _WHY_FINITE) -> str:
    nonfinite = ~torch.isfinite(t)
    if bool(nonfinite.any()):
        kinds = [
            kind for kind, mask in (("NaN", torch.isnan(t)), ("+inf", t == float("inf")), ("-inf", t == float("-inf")))
            if bool(mask.any())
        ]
        return (
            f"{label} hold {int(nonfinite.sum())} non-finite entries ({', '.join(kinds)}), the first at "
            f"{layout} {nonfinite.nonzero()[0].tolist()}: {why}"
        )
    beyond = t.abs() > F32_MAX
    return (
        f"{label} are float64 with {int(beyond.sum())} entries beyond float32's range (|x| > {F32_MAX:.4g}; "
        f"the largest is {float(t.abs().max()):.4g}), the first at {layout} {beyond.nonzero()[0].tolist()}: "
        "scores are computed in float32, so scale the inputs down"
    )


def _check_output(stage: str, what: str, t: object, inp: EvictionInput, *, want_bool: bool) -> None:
    """A stage's result must be one entry per row, KV head and slot: never broadcast, never cast."""
    expected = (inp.batch, inp.num_kv_heads, inp.num_slots)
    if not isinstance(t, torch.Tensor):
        raise SelectionError(f"{stage} returned {type(t).__name__}, expected {what} as a [B, Hkv, N] = {expected} tensor")
    if tuple(t.shape) != expected:
        raise SelectionError(
            f"{stage} returned {what} of shape {tuple(t.shape)}, expected [B, Hkv, N] = {expected} "
            "(one entry per row, KV head and slot: a result is never broadcast)"
        )
    if want_bool and t.dtype != torch.bool:
        raise SelectionError(f"{stage} returned {what} of dtype {t.dtype}, expected torch.bool")
    if not want_bool and not t.is_floating_point():
        raise SelectionError(f"{stage} returned {what} of dtype {t.dtype}, expected a floating dtype (float32)")
    if t.device != inp.keys.device:
        raise SelectionError(f"{stage} returned {what} on {t.device}, expected the inputs' device {inp.keys.device}")


def run_merge(merge: Merge, inp: EvictionInput, keep: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``merge.merge(inp, keep)``, checked: ``(values [B, Hkv, N, Dv]`` in the inputs' values dtype,
    the stage's state fields)``. One synchronisation.

    Refuses (``SelectionError`` naming the merge) values of another shape than ``inp.values``
    (never broadcast), not floating or on another device, NaN or inf on a kept slot, and state
    that is not exactly the stage's fields, each of the shape and dtype it had, finite on valid
    slots. Kept slots' values are taken from the result, every other slot's from ``inp.values``.
    """
    name = f"merge {merge.type_name!r}"
    result = merge.merge(inp, keep)
    values = getattr(result, "values", None)
    if not isinstance(values, torch.Tensor):
        raise SelectionError(f"{name} returned {type(result).__name__} without a values tensor, expected a MergeResult")
    if tuple(values.shape) != tuple(inp.values.shape):
        raise SelectionError(
            f"{name} returned values of shape {tuple(values.shape)}, expected [B, Hkv, N, Dv] = "
            f"{tuple(inp.values.shape)} (never broadcast)"
        )
    if not values.is_floating_point() or values.device != inp.values.device:
        raise SelectionError(f"{name} returned {values.dtype} values on {values.device}, expected floating values on "
                             f"{inp.values.device}")
    declared = merge.state_fields
    state = dict(result.state)
    if set(state) != set(declared):
        raise SelectionError(f"{name} returned state fields {sorted(state)}, expected exactly {sorted(declared)}")
    checks = [(~torch.isfinite(values) & keep[..., None]).any()]
    for field, spec in declared.items():
        before, t = inp.state_of(merge)[field], state[field]
        if not isinstance(t, torch.Tensor) or t.shape != before.shape or t.dtype != spec.dtype or t.device != before.device:
            raise SelectionError(f"{name} state field {field!r} must keep the shape, dtype and device it had "
                                 f"({tuple(before.shape)} {spec.dtype} on {before.device})")
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            checks.append((bad & inp.slot_valid if spec.per == "slot" else bad).any())
    flags = torch.stack(checks).tolist()
    if flags[0]:
        raise SelectionError(f"{name} produced NaN or inf values on kept slots: merged values must stay finite")
    if any(flags[1:]):
        field = list(declared)[flags[1:].index(True)]
        raise SelectionError(f"{name} state field {field!r} holds non-finite values: state must stay finite")
    merged = torch.where(keep[..., None], values.to(inp.values.dtype), inp.values)
    return merged, state
