"""The worker side: vLLM's model runner feeding each request's slots to the paged cache.

One ``WorkerEviction`` lives in each worker process (one per tensor-parallel rank), attached to
its model runner. It holds a ``PagedCache`` (``kvpolicy.vllm.paged_cache``: the requests' slots,
query rings and kept state, and the eviction itself, through the same core as ``EvictingCache``)
and does only what needs vLLM:

1. requests joining, finishing and resuming after preemption (``GPUModelRunner._update_states``);
2. before the forward (``GPUModelRunner._prepare_inputs``, wrapped): leaves RoPE positions
   counting real tokens, makes the attention length the slots held (``seq_lens``) and the slot
   each new token is written to (``slot_mapping``) follow each request's slot count, and starts
   the paged cache's step;
3. during the forward (the ``forward`` of each layer's attention backend, wrapped: see
   ``kvpolicy.vllm.hooks``): names the layer (refused at start-up if vLLM's layers carry no name
   the worker knows) and hands the paged cache its post-RoPE queries;
4. after the forward (``GPUModelRunner.execute_model``, wrapped): the paged cache evicts the due
   requests, and the runner's own records of their block tables follow (the scheduler returns the
   freed blocks to vLLM's pool: see ``kvpolicy.vllm.scheduler``). Under layer budgets decided from
   the prompt (CAKE) a first eviction's budgets are decided here, from every group's layer, before
   any group evicts; the scheduler asks for them (``reported_layer_budgets``) and then says which
   blocks each group keeps (``trim_blocks``).

At start-up it also builds the model facts of its rank (``kvpolicy.vllm.facts``: RoPE, and its
shard of each ``o_proj``) for the stages that read the model, and checks the server's policy
against them (each request's own policy is checked when the paged cache first loads it).

Under per-layer budgets (a KV-cache group per layer, ``kvpolicy.vllm.layer_spec``) it holds a
``PagedCache`` per group, each on its group's block table; each group's slot mapping and
attention length (``group_metadata``, through the wrapped metadata builder) follow its own slots.

A request resumed after preemption replays its evictions (``kvpolicy.vllm.ledger``). The cache is
read and written through ``BlockLayout`` (``kvpolicy.vllm.layout``), from the layout vLLM
resolved for the server and the backend's block interior.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..stages.model_facts import ModelFacts, ModelFactsError
from . import block_kernel, contract
from .facts import model_facts
from .layout import BlockLayout, LayoutError
from .paged import gather_paged
from .paged_cache import PagedCache
from .prompt_budgets import decide_layer_budgets
from .requests import StepRequests
from .select import BlockSelection
from .settings import KVPolicyVLLMError, Resolved, request_policy
from .support import KVPolicyInvariantError

logger = logging.getLogger(__name__)

#: The worker state of this process (one model runner per worker process).
_ACTIVE: WorkerEviction | None = None


class WorkerEviction:
    def __init__(self, runner: Any, resolved: Resolved) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        from .layer_spec import LayerKVCacheSpec

        self.runner = runner
        self.resolved = resolved  # the server's policy: requests naming none run it
        # Every vLLM attribute read below and at each step, refused by name if this release lacks one.
        contract.check_all([(runner, contract.MODEL_RUNNER), (runner.input_batch, contract.INPUT_BATCH),
                            (runner.vllm_config.cache_config, contract.CACHE_CONFIG)])
        groups = runner.kv_cache_config.kv_cache_groups
        contract.check_all((g, contract.KV_CACHE_GROUP) for g in groups)
        # One KV-cache group for every layer, or (a server under per-layer budgets:
        # ``kvpolicy.vllm.layer_spec``) one group per layer, each with its own block table.
        self.per_layer = len(groups) > 1
        if self.per_layer and any(len(g.layer_names) != 1 or not isinstance(g.kv_cache_spec, LayerKVCacheSpec)
                                  for g in groups):
            raise KVPolicyVLLMError(f"expected one KV cache group (full attention everywhere) or one per layer "
                                    f"(per-layer budgets), got {len(groups)}")
        spec = groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        names = sorted((n for g in groups for n in g.layer_names), key=extract_layer_index)
        ctx = runner.compilation_config.static_forward_context
        check_layer_names(names, ctx)
        contract.check_all((ctx[n], contract.ATTENTION_LAYER) for n in names)
        contract.check_all((ctx[n].impl, contract.ATTENTION_IMPL) for n in names)
        for n in names:  # select mode's kernel call (the builders set each layer's ISA before this)
            if block_kernel.runs_cpu_kernel(ctx[n].impl):
                block_kernel.check(ctx[n].impl, ctx[n])
        self.layer_of = {name: i for i, name in enumerate(names)}
        #: by the index of a layer in ``names``: its KV-cache group and its index among the group's layers
        if self.per_layer:  # each group holds one layer (checked above)
            group_by_name = {grp.layer_names[0]: g for g, grp in enumerate(groups)}
            self.group_of = {i: (group_by_name[n], 0) for i, n in enumerate(names)}
        else:
            self.group_of = {i: (0, i) for i in range(len(names))}
        caches: list[torch.Tensor] = [ctx[n].kv_cache for n in names]
        # Per-layer groups share one tensor (vLLM's kv_cache_tensors: every layer's group draws its
        # blocks from one pool), each block held by one layer; shared tensors are refused otherwise.
        if not self.per_layer and len({c.data_ptr() for c in caches}) != len(caches):
            raise KVPolicyVLLMError("layers sharing one KV cache tensor (KV sharing) are not supported")
        self.kv_heads = int(caches[0].shape[1])
        impl = ctx[names[0]].impl
        q_heads, head_dim = int(impl.num_heads), int(impl.head_size)
        self.q_heads, self.head_dim = q_heads, head_dim
        backends = {ctx[n].attn_backend.get_name() for n in names}
        if len(backends) != 1:
            raise KVPolicyVLLMError(f"layers on different attention backends are not supported: {sorted(backends)}")
        try:
            self.layout = BlockLayout.for_backend(backends.pop(), runner.vllm_config.cache_config.kv_cache_layout,
                                                  head_dim)
            kv = [self.layout.split(c) for c in caches]  # [num_blocks, block_size, Hkv, D] views
        except LayoutError as exc:
            raise KVPolicyVLLMError(f"KV cache layout: {exc}") from None
        self.impl_classes = {type(ctx[n].impl) for n in names}
        # Under per-layer budgets each group's attention length is its own (``group_metadata``).
        self.builder_classes = {ctx[n].attn_backend.get_builder_cls() for n in names} if self.per_layer else set()
        self.group_seq_lens: dict[int, tuple[torch.Tensor, int]] = {}  # this step's, by group (per-layer budgets)
        self.builders_checked: set[type] = set()  # metadata builders exist per group: checked at their first build
        self.device = caches[0].device
        self.held_generators: dict[int, torch.Generator] = {}  # see _hold_generators
        self.layout_checked = False
        # Under tensor parallelism this rank holds KV heads [head_offset, head_offset + kv_heads) of
        # the model's (start-up refuses a TP size that does not divide them): it evicts those
        # alone, drawing what an unsharded run draws for them (EvictionInput.head_offset).
        self.rank = int(get_tensor_model_parallel_rank())
        layer_ids = [extract_layer_index(n) for n in names]
        head_offset = self.rank * self.kv_heads
        # What stages that read the model get (RoPE, this rank's shard of each o_proj), checked
        # against every policy as it is first loaded: the server's here, at start-up.
        self.model_facts = rank_facts(runner, dict(zip(layer_ids, names, strict=True)), head_offset)
        members = ([[i for i in range(len(names)) if self.group_of[i][0] == g] for g in range(len(groups))]
                   if self.per_layer else [list(range(len(names)))])
        # A paged cache per KV-cache group (every layer's, or one layer's), on the group's block table.
        self.pageds = [PagedCache(
            [kv[i] for i in member], [layer_ids[i] for i in member], q_heads=q_heads, head_dim=head_dim,
            block_size=self.block_size, policy_of=self._resolve, head_offset=head_offset,
            prefix_caching=bool(runner.vllm_config.cache_config.enable_prefix_caching),
            trace=Path(resolved.trace) if resolved.trace else None, rank=self.rank, model_facts=self.model_facts,
            per_head_refusal=per_head_refusal(ctx[names[0]].impl), model_layers=len(names) if self.per_layer else None,
        ) for member in members]
        self.paged = self.pageds[0]
        for paged in self.pageds:
            paged.check_policy(resolved.policy())
        self.select = BlockSelection(self.paged)  # select-mode requests' page choices (kvpolicy.vllm.select)
        #: Whether this step has requests whose heads hold different counts (``PagedCache.head_attention``):
        #: asked at every layer's cache write and attention, so decided once per step (``after_prepare_inputs``).
        self.head_attention = False

    @property
    def long_steps(self) -> bool:
        """Whether this step has requests whose chunk is longer than their window (``PagedCache.long_steps``)."""
        return any(p.long_steps for p in self.pageds)

    @property
    def ledger(self):
        return self.paged.ledger

    def _resolve(self, req_id: str) -> Resolved:
        state = self.runner.requests.get(req_id)
        if state is None:  # the server's policy would stand in for the request's own, and its ledger differ
            raise KVPolicyInvariantError(f"request {req_id} runs, but the model runner holds no record of it: "
                                         "its kvpolicy settings cannot be read")
        params = state.sampling_params
        return request_policy(None if params is None else params.extra_args, self.resolved)

    def _block_table(self, group: int = 0) -> Any:
        return self.runner.input_batch.block_table.block_tables[group]

    def _route(self, layer: Any) -> tuple[PagedCache, int, int]:
        """The paged cache of an attention layer's KV-cache group, the layer's index there, and the group."""
        g, local = self.group_of[self._layer(layer)]
        return self.pageds[g], local, g

    def _layer(self, layer: Any) -> int:
        """The index of an attention layer of the model, by the name vLLM gives it."""
        name = layer.layer_name  # the contract's (checked at start-up)
        index = self.layer_of.get(name)
        if index is None:
            raise KVPolicyVLLMError(
                f"an attention layer named {name!r} ran, which is not one of the KV cache's layers "
                f"({len(self.layer_of)} known): kvpolicy cannot capture its queries"
            )
        return index

    # -- requests joining and leaving -------------------------------------------------------
    def on_update_states(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            for paged in self.pageds:
                paged.drop(req_id)
            self.select.drop(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            for paged in self.pageds:
                paged.drop(new.req_id)  # a new request, or one resubmitted under the same id
            self.select.drop(new.req_id)
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            self.select.drop(req_id)  # recomputed: it chooses anew
            plans = [paged.resume(req_id) for paged in self.pageds]  # each group replays its own points
            plan = sorted({p for group in plans for p in group or []})
            if plan and self.rank == 0:
                logger.info("kvpolicy: request %s resumes after preemption, replaying %d eviction(s)",
                            req_id, len(plan))

    # -- before the forward -----------------------------------------------------------------
    def after_prepare_inputs(self, num_scheduled: np.ndarray) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        n = np.asarray(num_scheduled[:num_reqs], dtype=np.int64)
        before = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        prompt = batch.num_prompt_tokens[:num_reqs].astype(np.int64)
        total = int(n.sum())
        # Each group's own slot count: group 0's (every layer's, with one group) makes the runner's
        # attention length; under per-layer budgets every other group's is its attention
        # metadata's (``group_metadata``), and each group's slot mapping follows its own slots.
        unevicted = runner.seq_lens.clone()  # every token: a group that evicted nothing yet attends them all
        offsets = np.array([[paged.ledger.offset(r) for r in req_ids] for paged in self.pageds],
                           dtype=np.int64).reshape(len(self.pageds), num_reqs)  # [groups, R]
        evicted = np.flatnonzero(offsets.any(axis=1)).tolist()
        off = torch.from_numpy(offsets)
        self.group_seq_lens = {}
        if self.per_layer:  # every group's lengths in one go: [groups, max_reqs]
            lens = unevicted.expand(len(self.pageds), -1).clone()
            lens[:, :num_reqs] -= off.to(lens.device, lens.dtype)
            longest = lens[:, :num_reqs].amax(dim=1).tolist() if num_reqs else [0] * len(self.pageds)
            self.group_seq_lens = {g: (lens[g], int(longest[g])) for g in range(1, len(self.pageds))}
        if evicted:
            if evicted[0] == 0:
                runner.seq_lens[:num_reqs] -= off[0].to(runner.seq_lens.device, runner.seq_lens.dtype)
                runner.optimistic_seq_lens_cpu[:num_reqs] -= off[0].to(runner.optimistic_seq_lens_cpu.dtype)
            per_token = torch.from_numpy(np.repeat(offsets[evicted], n, axis=1)).to(runner.positions.device,
                                                                                     runner.positions.dtype)
            slots = runner.positions[:total][None] - per_token  # [evicted groups, T]
            starts = runner.query_start_loc.gpu[: num_reqs + 1]
            for row, g in enumerate(evicted):
                table = batch.block_table if not self.per_layer else batch.block_table.block_tables[g]
                table.compute_slot_mapping(num_reqs, starts, slots[row])
        self._hold_generators(num_reqs)
        step = StepRequests(req_ids, n, before, prompt)  # one for every group: what they plan alike is planned once
        for g, paged in enumerate(self.pageds):
            paged.begin_step(step, self._block_table(g))
        self.head_attention = any(p.head_attention is not None for p in self.pageds)
        self.select.begin_step(step, self._block_table())
        for g, paged in enumerate(self.pageds):
            self._attend_one_slot(g, paged.skipped_rows() + (self.select.skipped_rows() if g == 0 else []))

    def _attend_one_slot(self, group: int, rows: list[int]) -> None:
        """Shorten ``group``'s attention length of ``rows`` to one slot: their rows of every layer's
        output are kvpolicy's alone (``BlockSelection.attend``, ``PagedCache.attend_heads``), so the
        kernel need not read their slots (it still writes the step's keys through the slot mapping)."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        runner = self.runner
        if group == 0:  # the runner's own length, which every group's metadata starts from
            runner.seq_lens[index.to(runner.seq_lens.device)] = 1
            runner.optimistic_seq_lens_cpu[index] = 1
            return
        lens, longest = self.group_seq_lens[group]
        lens = lens.clone()  # groups that evicted nothing share one tensor
        lens[index.to(lens.device)] = 1
        self.group_seq_lens[group] = (lens, longest)

    def group_metadata(self, builder: Any, common: Any) -> Any:
        """The common attention metadata a KV-cache group's builder gets: under per-layer budgets,
        its own attention length (``seq_lens``: its slots, not group 0's); else unchanged."""
        if not self.group_seq_lens:
            return common
        if type(builder) not in self.builders_checked:
            contract.check(builder, contract.METADATA_BUILDER)
            self.builders_checked.add(type(builder))
        names = list(builder.layer_names)
        index = self.layer_of.get(names[0]) if len(names) == 1 else None
        if index is None:  # every group holds one known layer (checked at start-up): group 0's length would be wrong
            raise KVPolicyInvariantError(
                f"a metadata builder of layers {names[:4]} is not one KV-cache group's single attention layer: "
                "its attention length would be another layer's"
            )
        found = self.group_seq_lens.get(self.group_of[index][0])
        if found is None:  # group 0: the runner's own
            return common
        lens, longest = found
        mine = copy.copy(common)
        mine.seq_lens = lens[: common.seq_lens.shape[0]]
        mine.max_seq_len = longest
        return mine

    @property
    def plan(self) -> StepRequests | None:
        return self.paged.plan

    @plan.setter
    def plan(self, value: StepRequests | None) -> None:
        for paged in self.pageds:
            paged.plan = value

    def _hold_generators(self, num_reqs: int) -> None:
        """Take the seeded generators of requests whose step ends inside their known tokens (a
        prefill chunk: vLLM discards what it samples for them) until sampling is done.

        vLLM rewinds such a generator with ``set_offset``, which CPU generators lack ("CPU
        Generator does not use offset"): a seeded request recomputed in chunks after preemption
        would stop the engine. Held back, the generator draws nothing for the discarded sample,
        which is what the rewind is for: the request samples as if the chunk had not happened."""
        self.held_generators = {}
        mask = self.runner.discard_request_mask  # the contract's (checked at start-up)
        gens = self.runner.input_batch.generators
        if not gens:
            return
        for i in np.flatnonzero(mask.np[:num_reqs]).tolist():
            if i in gens:
                self.held_generators[i] = gens.pop(i)

    def restore_generators(self) -> None:
        if self.held_generators:
            self.runner.input_batch.generators.update(self.held_generators)
            self.held_generators = {}

    # -- during the forward -----------------------------------------------------------------
    def capture_queries(self, layer: Any, query: torch.Tensor) -> None:
        """Before ``layer``'s attention (an attention layer of the model): its post-RoPE queries."""
        paged, local, _ = self._route(layer)
        if paged.captures:
            paged.capture_queries(local, query)

    def attend_heads(self, layer: Any, query: torch.Tensor, output: torch.Tensor, impl: Any,
                     kv_cache: torch.Tensor) -> None:
        """After ``layer``'s attention (``impl``'s, over ``kv_cache``; its keys are in the cache): the
        requests whose heads hold different counts (per-head budgets) attend each head's own
        slots, over vLLM's output; a decode step's read in place by the CPU backend's kernel
        (``kvpolicy.vllm.block_kernel``), one sequence per request and KV head."""
        paged, local, _ = self._route(layer)
        paged.attend_heads(local, query, output, impl.scale, block_kernel.kernel_for(impl, layer, kv_cache))

    def moved_tokens(self, layer: Any) -> None:
        """After vLLM wrote ``layer``'s keys and values of the step: under per-head budgets, each
        head's copy of a new token goes to the end of that head's own slots (``PagedCache.moved_tokens``)."""
        paged, local, _ = self._route(layer)
        paged.moved_tokens(local)

    def after_attention(self, layer: Any, query: torch.Tensor) -> None:
        """After ``layer``'s attention (its keys are in the cache): the long steps' queries."""
        paged, local, g = self._route(layer)
        if paged.long_steps:
            paged.after_attention(local, query, self._block_table(g))

    def attend_selected(self, layer: Any, query: torch.Tensor, output: torch.Tensor, impl: Any,
                        kv_cache: torch.Tensor) -> None:
        """After ``layer``'s attention (``impl``'s, over ``kv_cache``): the rows of requests attending
        a selection at this step become attention over their chosen blocks (``kvpolicy.vllm.select``);
        whole blocks are read in place by the CPU backend's kernel (``kvpolicy.vllm.block_kernel``,
        its contract checked at start-up)."""
        kernel = block_kernel.kernel_for(impl, layer, kv_cache)
        self.select.attend(self._layer(layer), query, output, impl.scale, kernel)

    def check_layout(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Once: the cache holds what this module assumes (a plain, unpacked layout)."""
        self.layout_checked = True
        if key.shape[0] == 0 or int(slot_mapping[0]) < 0:
            self.layout_checked = False
            return
        slot = int(slot_mapping[0])
        blocks = torch.tensor([[slot // self.block_size]], device=self.device)
        offs = torch.tensor([[slot % self.block_size]], device=self.device)
        k, v = gather_paged(self.layout.split(kv_cache), blocks, offs)
        if not (torch.equal(k[0, :, 0], key[0].view(self.kv_heads, -1).to(k.dtype))
                and torch.equal(v[0, :, 0], value[0].view(self.kv_heads, -1).to(v.dtype))):
            raise KVPolicyVLLMError(
                f"the KV cache does not hold the first keys where layout {self.layout.name} "
                f"({self.layout.interior}) puts them (a packed ISA layout?); cache dtype {kv_cache.dtype}: "
                "use dtype float32 or bfloat16 without AMX packing"
            )

    # -- after the forward ------------------------------------------------------------------
    def after_execute(self) -> None:
        self.select.end_step()  # this step's selections are spent
        self.group_seq_lens = {}
        tables = [self._block_table(g) for g in range(len(self.pageds))]
        dues = [paged.advance_step() for paged in self.pageds]
        if self.per_layer:  # CAKE: a first eviction's layer budgets, from every layer, before any evicts
            decide_layer_budgets(self.pageds, dues, tables)
        for g, (paged, due) in enumerate(zip(self.pageds, dues, strict=True)):
            for ev in paged.evict_due(due, tables[g]):
                state = self.runner.requests.get(ev.req_id)
                if state is None:  # its block ids would keep blocks the scheduler has freed
                    raise KVPolicyInvariantError(
                        f"request {ev.req_id} evicted in KV-cache group {g}, but the model runner holds no record "
                        "of it: its block ids could not follow the eviction"
                    )
                state.block_ids[g][:] = ev.blocks

    def layer_budgets(self, req_ids: list[str]) -> dict[str, list[int]]:
        """The layer budgets this worker decided for requests at their first eviction (by layer)."""
        return {r: [paged.decided_budget(r) for paged in self.pageds] for r in req_ids
                if self.pageds[0].decided_budget(r)}

    def trim(self, keep: dict[str, list[int]]) -> None:
        """The scheduler freed the blocks past each request's first ``keep[req][group]`` (it learned
        the layer budgets of its first eviction): the runner's block tables follow."""
        batch = self.runner.input_batch
        for req_id, counts in keep.items():
            state = self.runner.requests.get(req_id)
            if state is None:
                continue
            row = batch.req_id_to_index.get(req_id)
            for g, (paged, n) in enumerate(zip(self.pageds, counts, strict=True)):
                state.block_ids[g][:] = paged.trimmed(req_id, list(state.block_ids[g]), n)
                if row is not None:
                    self._block_table(g).add_row(state.block_ids[g], row)


def rank_facts(runner: Any, layers: dict[int, str], head_offset: int) -> ModelFacts:
    """The model facts of this rank's share of the runner's model (``kvpolicy.vllm.facts``)."""
    model_config = runner.vllm_config.model_config
    try:
        return model_facts(runner.get_model(), model_config.hf_text_config, layers, name=str(model_config.model),
                           head_offset=head_offset)
    except ModelFactsError as exc:
        raise KVPolicyVLLMError(f"the model's facts (RoPE, output projections): {exc}") from None


def per_head_refusal(impl: Any) -> str | None:
    """Why ``kvpolicy.attend.attend_heads`` cannot stand in for this attention backend's kernel
    for requests whose heads hold different counts (None: it can): it computes plain scaled
    softmax attention, without ALiBi, logit soft-capping, attention sinks or a sliding window."""
    extras = []  # each may be None, but vLLM 0.32's impls set all four (the worker checks ATTENTION_IMPL first)
    if impl.alibi_slopes is not None:
        extras.append("ALiBi")
    if impl.logits_soft_cap not in (None, 0, 0.0):
        extras.append("logit soft-capping")
    if impl.sinks is not None:
        extras.append("attention sinks")
    if impl.sliding_window not in (None, -1, (-1, -1)):
        extras.append("a sliding window")
    if not extras:
        return None
    return f"its attention uses {', '.join(extras)}, which kvpolicy's per-head attention does not compute"


def check_layer_names(names: list[str], ctx: Any) -> None:
    """Refuse, at start-up, attention layers the worker could not name while they run: the
    attention hooks find a layer by its ``layer_name``, and a layer without it (or with another
    name than the KV cache's) would leave its query window empty without a word."""
    contract.check_all((ctx[n], contract.ATTENTION_LAYER.only("layer_name")) for n in names)
    wrong = [n for n in names if ctx[n].layer_name != n]
    if wrong:
        raise KVPolicyVLLMError(
            f"attention layer(s) {wrong[:4]} do not carry their own name as `layer_name`: kvpolicy finds a "
            "layer's query window by it, and refuses to run without it"
        )


# -- wrappers installed on vLLM's classes at plugin load (see kvpolicy.vllm.hooks) ------------------
def runner_eviction(runner: Any) -> WorkerEviction | None:
    """The ``WorkerEviction`` of a model runner, None when it does not evict."""
    return runner.__dict__.get("_kvpolicy")


def init_runner(runner: Any) -> WorkerEviction | None:
    """After ``initialize_kv_cache``: switch eviction on for this runner if the server asked.

    Returns the runner's state (None: no eviction); the caller (``kvpolicy.vllm.hooks``) then
    wraps its attention backends (``WorkerEviction.impl_classes``)."""
    global _ACTIVE
    resolved = Resolved.from_additional_config(runner.vllm_config.additional_config)
    if resolved is None:
        return None
    state = WorkerEviction(runner, resolved)
    runner.__dict__["_kvpolicy"] = state
    _ACTIVE = state
    return state


def reported_layer_budgets(worker: Any, req_ids: list[str]) -> dict[str, list[int]]:
    """The layer budgets this rank's worker decided for ``req_ids`` at their first eviction
    (``WorkerEviction.layer_budgets``). Called by the scheduler (``collective_rpc``) once the step
    that decided them has run."""
    state = runner_eviction(worker.model_runner)
    return {} if state is None else state.layer_budgets(req_ids)


def trim_blocks(worker: Any, keep: dict[str, list[int]]) -> None:
    """The scheduler's trim of requests whose layer budgets it just learned (``WorkerEviction.trim``),
    called (``collective_rpc``) before it schedules another step."""
    state = runner_eviction(worker.model_runner)
    if state is not None:
        state.trim(keep)


def worker_facts(worker: Any) -> tuple[dict[str, str], dict[str, Any] | None]:
    """The model facts this rank's worker cannot give, with the reason (``ModelFacts.missing``),
    and the fingerprint of the model's heads it holds (``ModelFacts.model_fingerprint``, as
    ``ModelFingerprint.to_dict``; None where it has none: the missing facts say why); nothing
    where it does not evict. Called on every rank by the engine core at start-up
    (``collective_rpc``: ``scheduler.Workers.ask``), so a request needing a fact, or calibrated
    on another model, is refused alone, before it runs."""
    state = runner_eviction(worker.model_runner)
    if state is None:
        return {}, None
    fingerprint, _ = state.model_facts.model_fingerprint()
    return dict(state.model_facts.missing), None if fingerprint is None else fingerprint.to_dict()


def active() -> WorkerEviction | None:
    return _ACTIVE
