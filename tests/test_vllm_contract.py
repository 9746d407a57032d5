"""kvpolicy.vllm.contract: every vLLM attribute the integration reads is checked at start-up and
refused by name; memory invariants raise (under ``python -O`` too). The real-vLLM part runs where
vLLM is importable (``.venv-vllm``) and is skipped elsewhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvpolicy.vllm import contract
from kvpolicy.vllm.support import KVPolicyInvariantError, KVPolicyVLLMError

CONTRACTS = [value for value in vars(contract).values() if isinstance(value, contract.Contract)]
PAIRS = [(c, name) for c in CONTRACTS for name in c.reads]


def complete(c: contract.Contract) -> SimpleNamespace:
    """An object carrying every attribute ``c`` lists (None: vLLM's own 'not used' value)."""
    return SimpleNamespace(**dict.fromkeys(c.reads))


def test_every_contract_is_listed_and_says_why():
    assert len(CONTRACTS) >= 15 and len(PAIRS) >= 60
    for c in CONTRACTS:
        assert c.owner.startswith("vllm.") and c.reads
        assert all(why.strip() for why in c.reads.values()), c.owner
    # the ones the issue found read through silent defaults
    assert "discard_request_mask" in contract.MODEL_RUNNER.reads
    assert "layer_names" in contract.METADATA_BUILDER.reads
    assert {"alibi_slopes", "logits_soft_cap", "sinks", "sliding_window"} <= set(contract.ATTENTION_IMPL.reads)
    assert {"decode_context_parallel_size", "prefill_context_parallel_size"} <= set(contract.PARALLEL_CONFIG.reads)


@pytest.mark.parametrize(("c", "name"), PAIRS, ids=[f"{c.owner.rsplit('.', 1)[-1]}.{n}" for c, n in PAIRS])
def test_an_object_missing_a_relied_on_attribute_is_refused_by_name(c, name):
    contract.check(complete(c), c)  # all there: passes, whatever the values (None included)
    fake = complete(c)
    delattr(fake, name)
    with pytest.raises(KVPolicyVLLMError) as caught:
        contract.check(fake, c)
    message = str(caught.value)
    assert f"no attribute {name!r}" in message
    assert c.owner in message and "SimpleNamespace" in message
    assert f"vLLM {contract.CONTRACT_VLLM}" in message and ">=0.32,<0.33" in message
    assert c.reads[name] in message  # and why kvpolicy reads it


def test_every_missing_attribute_is_named_at_once():
    fake = complete(contract.ATTENTION_IMPL)
    del fake.sinks, fake.sliding_window
    with pytest.raises(KVPolicyVLLMError, match="'sinks' .*'sliding_window'"):
        contract.check(fake, contract.ATTENTION_IMPL)


def test_classes_are_checked_by_their_declared_fields_and_properties_are_not_run():
    @dataclasses.dataclass
    class Output:
        finished_req_ids: set
        scheduled_new_reqs: list
        scheduled_cached_reqs: object

    three = contract.SCHEDULER_OUTPUT.only("finished_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs")
    contract.check(Output, three)  # fields without defaults: not class attributes

    @dataclasses.dataclass
    class Renamed:
        finished_request_ids: set
        scheduled_new_reqs: list
        scheduled_cached_reqs: object

    with pytest.raises(KVPolicyVLLMError, match="'finished_req_ids'"):
        contract.check(Renamed, three)

    class Annotated:
        seq_lens: torch.Tensor

        @property
        def max_seq_len(self) -> int:
            raise RuntimeError("a property must not run during the check")

    contract.check(Annotated, contract.COMMON_ATTENTION_METADATA)
    contract.check(Annotated(), contract.COMMON_ATTENTION_METADATA.only("max_seq_len"))
    # an instance must carry what its class only declares
    with pytest.raises(KVPolicyVLLMError, match="'seq_lens'"):
        contract.check(Annotated(), contract.COMMON_ATTENTION_METADATA)


def test_the_scheduler_and_each_groups_manager_are_checked():
    def scheduler(*managers):
        coordinator = SimpleNamespace(single_type_managers=list(managers))
        manager = SimpleNamespace(**{**vars(complete(contract.KV_CACHE_MANAGER)), "coordinator": coordinator,
                                     "block_pool": complete(contract.BLOCK_POOL)})
        return SimpleNamespace(**{**vars(complete(contract.SCHEDULER)), "kv_cache_manager": manager})

    class Manager(SimpleNamespace):
        def get_num_blocks_to_allocate(self, request_id, num_tokens, *counts, apply_admission_cap=False):
            raise AssertionError("the check must not call it")

    def manager():
        return Manager(**vars(complete(contract.SINGLE_TYPE_MANAGER)))

    group = manager()
    contract.check_scheduler(scheduler(group, group))
    renamed = manager()
    del renamed.kv_cache_group_id
    with pytest.raises(KVPolicyVLLMError, match="SingleTypeKVCacheManager .*'kv_cache_group_id'"):
        contract.check_scheduler(scheduler(group, renamed))

    class Unmarked(Manager):  # a vLLM whose admission check no longer says so
        def get_num_blocks_to_allocate(self, request_id, num_tokens, *counts):
            raise AssertionError("the check must not call it")

    unmarked = Unmarked(**vars(complete(contract.SINGLE_TYPE_MANAGER)))
    with pytest.raises(KVPolicyVLLMError, match=r"get_num_blocks_to_allocate .*no parameter 'apply_admission_cap' "
                                                r"\(read for: marks vLLM's admission check"):
        contract.check_scheduler(scheduler(group, unmarked))


def test_the_contract_names_the_version_the_makefile_installs():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    found = re.search(r"^VLLM_VERSION\s*:?=\s*(\S+)", makefile, re.M)
    assert found is not None and found.group(1) == contract.CONTRACT_VLLM


def test_a_layer_without_its_name_is_refused_by_the_contract():
    from kvpolicy.vllm.worker import check_layer_names

    names = ["model.layers.0.self_attn.attn"]
    with pytest.raises(KVPolicyVLLMError, match=r"no attribute 'layer_name'.*vLLM 0\.32\.0"):
        check_layer_names(names, {names[0]: SimpleNamespace(name=names[0])})


# -- memory invariants: raised, not asserted (``python -O -m pytest`` keeps them: pytest.raises is
# no assert) ----------------------------------------------------------------------------------------
def _worker(**fields):
    from kvpolicy.vllm.worker import WorkerEviction

    worker = WorkerEviction.__new__(WorkerEviction)  # no vLLM: only the per-step rules run
    worker.__dict__.update(fields)
    return worker


def test_a_group_metadata_builder_not_of_one_known_layer_raises():
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    lens = torch.tensor([5, 7])
    worker = _worker(layer_of={n: i for i, n in enumerate(names)}, group_of={0: (0, 0), 1: (1, 0)},
                     group_seq_lens={1: (lens, 7)}, builders_checked=set())
    common = SimpleNamespace(seq_lens=torch.tensor([9, 9]), max_seq_len=9)
    mine = worker.group_metadata(SimpleNamespace(layer_names=[names[1]], build=None), common)
    assert mine.seq_lens.tolist() == [5, 7] and mine.max_seq_len == 7 and common.max_seq_len == 9
    assert worker.group_metadata(SimpleNamespace(layer_names=[names[0]], build=None), common) is common  # group 0
    with pytest.raises(KVPolicyInvariantError, match="would be another layer's"):
        worker.group_metadata(SimpleNamespace(layer_names=names, build=None), common)
    with pytest.raises(KVPolicyInvariantError, match="encoder"):
        worker.group_metadata(SimpleNamespace(layer_names=["encoder.attn"], build=None), common)
    fresh = _worker(**{**worker.__dict__, "builders_checked": set()})  # builders are checked once per class
    with pytest.raises(KVPolicyVLLMError, match="no attribute 'layer_names'"):
        fresh.group_metadata(SimpleNamespace(names=[names[1]], build=None), common)


def test_a_request_the_runner_does_not_hold_is_not_given_the_servers_policy():
    from kvpolicy.vllm.settings import Resolved, resolve, resolve_request

    server = Resolved(None, "none", 0)
    own = resolve_request({"kvpolicy": {"policy": "snapkv", "budget": 128}})
    runner = SimpleNamespace(requests={"a": SimpleNamespace(sampling_params=SimpleNamespace(extra_args=own))})
    worker = _worker(runner=runner, resolved=server)
    assert worker._resolve("a") == resolve({"policy": "snapkv", "budget": 128}, per_request=True)
    with pytest.raises(KVPolicyInvariantError, match="request b runs.*no record"):
        worker._resolve("b")


def test_an_eviction_the_runner_cannot_follow_raises():
    from kvpolicy.vllm.worker import WorkerEviction

    evicted = SimpleNamespace(req_id="b", blocks=[3, 4])
    paged = SimpleNamespace(advance_step=lambda: [(0, "b")], evict_due=lambda due, table: [evicted])
    table = SimpleNamespace(block_tables=[object()])
    held = SimpleNamespace(block_ids=[[3, 4, 8, 9]])
    runner = SimpleNamespace(requests={"b": held}, input_batch=SimpleNamespace(block_table=table))
    worker = _worker(runner=runner, pageds=[paged], per_layer=False, select=SimpleNamespace(end_step=lambda: None),
                     group_seq_lens={})
    WorkerEviction.after_execute(worker)
    assert held.block_ids == [[3, 4]]  # the runner's record follows the eviction
    runner.requests.clear()
    with pytest.raises(KVPolicyInvariantError, match="request b evicted .*no record"):
        WorkerEviction.after_execute(worker)


# -- vLLM 0.32's own classes pass (needs vLLM: .venv-vllm) -------------------------------------------
def test_vllm_classes_and_objects_pass_the_contract(monkeypatch):
    """vLLM 0.32.0's classes, and the objects that are cheap to build here; the model runner, its
    input batch and attention layers are checked by every engine test (tests/engine_vllm), whose
    workers run the same check at start-up."""
    pytest.importorskip("vllm", reason="vLLM not installed here (run in .venv-vllm)")
    import vllm
    from vllm.config import CacheConfig, ParallelConfig, VllmConfig
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    assert vllm.__version__.split("+")[0] == contract.CONTRACT_VLLM
    contract.check_all(zip(contract.per_step_classes(), contract.PER_STEP, strict=True))
    config = VllmConfig()
    contract.check(config, contract.VLLM_CONFIG)
    contract.check(ParallelConfig(), contract.PARALLEL_CONFIG)
    contract.check(CacheConfig(), contract.CACHE_CONFIG)
    # the impl reads the model's dtype from the current config (a model's, in a worker)
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    impl = CPUAttentionBackendImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                                   sliding_window=None, kv_cache_dtype="auto")
    contract.check(impl, contract.ATTENTION_IMPL)
    from kvpolicy.vllm.worker import per_head_refusal

    assert per_head_refusal(impl) is None
    windowed = CPUAttentionBackendImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                                       alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sliding_window=128,
                                       kv_cache_dtype="auto")
    why = per_head_refusal(windowed)
    assert why is not None and "ALiBi" in why and "a sliding window" in why
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    contract.check(KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec), contract.KV_CACHE_GROUP)
    builder = CPUAttentionBackend.get_builder_cls()
    assert contract.has(builder, "build") and CPUAttentionBackend.get_impl_cls() is CPUAttentionBackendImpl
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    contract.check_parameters(FullAttentionManager.get_num_blocks_to_allocate, contract.BLOCKS_TO_ALLOCATE)
