"""Start-up configuration and refusals, the slot ledger and paged compaction: no engine started."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm import additional_config  # noqa: E402
from kvpolicy.vllm.ledger import SlotLedger  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder, tiny_qwen3_folder  # noqa: E402
from kvpolicy.vllm.paged import compact, gather_slots  # noqa: E402
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved, check_version, requested, resolve  # noqa: E402


def engine_config(model, kvpolicy=None, **kwargs):
    import vllm  # noqa: F401  (loads the plugins: the entry point installs the hooks)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    args = dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=1024)
    args.update(kwargs)
    if kvpolicy is not None:
        args["additional_config"] = {"kvpolicy": kvpolicy}
    return EngineArgs(**args).create_engine_config()


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen3_folder()


# -- settings ---------------------------------------------------------------------------------
def test_resolve_carries_validated_yaml_and_seed():
    r = resolve({"policy": "snapkv", "budget": 128})
    policy = r.policy()
    assert policy.budget == 128 and policy.schedule.window == 64 and r.seed == 0
    again = Resolved.from_additional_config({"kvpolicy": r.to_dict()})
    assert again == r
    assert additional_config("snapkv", budget=128) == {"kvpolicy": {"policy": "snapkv", "budget": 128}}


def test_streamingllm_relative_recent_follows_budget():
    assert resolve({"policy": "streamingllm", "budget": 128}).policy().schedule.recent == 124


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(KVPolicyVLLMError, match="unknown policy 'no-such-policy'.*registered policies"):
        resolve({"policy": "no-such-policy"})


def test_invalid_policy_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nschedule: {budget: 64, recent: 8}\nselector: {type: greedy}\nscorer: {type: nope}\n")
    with pytest.raises(KVPolicyVLLMError, match="does not load"):
        resolve({"policy": str(bad)})


def test_unknown_setting_and_select_mode_are_refused():
    with pytest.raises(KVPolicyVLLMError, match="unknown setting"):
        resolve({"policy": "snapkv", "budgte": 3})
    with pytest.raises(KVPolicyVLLMError, match="evict mode only"):
        resolve({"policy": "snapkv@select"})
    for bad in (["budget", 64], "budget=64"):
        with pytest.raises(KVPolicyVLLMError, match='"overrides" must be a mapping'):
            resolve({"policy": "snapkv", "overrides": bad})


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("KVPOLICY_VLLM_POLICY", "streamingllm")
    monkeypatch.setenv("KVPOLICY_VLLM_OVERRIDES", json.dumps({"budget": 256}))
    entry = requested({})
    assert entry == {"policy": "streamingllm", "overrides": {"budget": 256}}
    assert resolve(entry).policy().budget == 256
    assert requested({"kvpolicy": {"policy": "snapkv"}}) == {"policy": "snapkv"}  # additional_config wins
    monkeypatch.setenv("KVPOLICY_VLLM_OVERRIDES", "{budget")
    with pytest.raises(KVPolicyVLLMError, match="not valid JSON"):
        requested({})


def test_version_range():
    check_version("0.32.0")
    for bad in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(KVPolicyVLLMError, match="not supported"):
            check_version(bad)


# -- start-up through vLLM's own EngineArgs ---------------------------------------------------
def test_engine_config_defaults_and_resolution(tiny):
    cfg = engine_config(tiny, {"policy": "snapkv", "budget": 128})
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.scheduler_config.async_scheduling is False
    assert Resolved.from_additional_config(cfg.additional_config).policy().budget == 128


def test_engine_without_kvpolicy_is_untouched(tiny):
    cfg = engine_config(tiny)
    assert "kvpolicy" not in cfg.additional_config
    assert cfg.cache_config.enable_prefix_caching is True  # vLLM's default stays


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_prefix_caching": True}, "prefix caching is on"),
        ({"async_scheduling": True}, "async scheduling is on"),
        ({"kv_cache_dtype": "fp8"}, "quantised KV cache"),
        ({"tensor_parallel_size": 4}, "tensor_parallel_size 4 does not divide the 2 KV heads"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
         "speculative decoding is not supported"),
        ({"data_parallel_size": 2}, "data parallelism is not supported"),
        ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}},
         "KV transfer / offloading connectors are not supported"),
    ],
)
def test_refusals(tiny, kwargs, message):
    with pytest.raises(KVPolicyVLLMError, match=message):
        engine_config(tiny, {"policy": "snapkv", "budget": 128}, **kwargs)


def test_refuses_pipeline_parallelism(tiny):
    with pytest.raises(Exception, match="pipeline"):
        engine_config(tiny, {"policy": "snapkv", "budget": 128}, pipeline_parallel_size=2)


def test_refuses_sliding_window_models(tiny, tmp_path):
    folder = tmp_path / "sliding"
    folder.mkdir()
    for f in Path(tiny).iterdir():
        if f.is_file():
            (folder / f.name).symlink_to(f)
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=256, max_window_layers=0,
               layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KVPolicyVLLMError, match="sliding-window|hybrid"):
        engine_config(folder, {"policy": "snapkv", "budget": 128})


def test_unknown_policy_refused_at_engine_start(tiny):
    with pytest.raises(KVPolicyVLLMError, match="unknown policy"):
        engine_config(tiny, {"policy": "nope"})


# -- the ledger -------------------------------------------------------------------------------
def test_ledger_follows_the_schedule_per_request():
    sched = load_policy("snapkv", budget=128).schedule  # interval 64
    led = SlotLedger(sched)
    assert not led.advance("a", 300, 300)  # a long prompt never evicts (no compress_prompt)
    fired = [t for t in range(301, 600) if led.advance("a", t, 300) and led.evicted("a")]
    assert fired[0] == 320 and all(b - a == 64 for a, b in zip(fired, fired[1:], strict=False))
    assert led.get("a").offset == 599 - led.get("a").slots
    # Chunked prefill: chunks never evict; the decode steps after it do.
    assert not led.advance("b", 100, 150) and not led.advance("b", 150, 150)
    assert [t for t in range(151, 260) if led.advance("b", t, 150) and led.evicted("b")] == [192, 256]


# -- paged gather and compaction against vLLM's own cache writer ------------------------------
def test_compaction_inside_blocks_matches_gathering():
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    bs, nb, h, d, t = 32, 8, 2, 64, 90
    cache = torch.zeros(nb, h, bs, 2 * d)
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    key, val = torch.randn(t, h, d), torch.randn(t, h, d)
    table = torch.tensor([[6, 2, 4], [1, 3, 7]])
    slots = table[0, torch.arange(t) // bs] * bs + torch.arange(t) % bs
    isa = _get_attn_isa(torch.float32, bs, d)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    blocks = table[:1, torch.arange(t) // bs].long()
    k, v = gather_slots(cache, blocks, (torch.arange(t) % bs)[None])
    assert torch.equal(k[0], key.transpose(0, 1)) and torch.equal(v[0], val.transpose(0, 1))
    kept = torch.stack([torch.randperm(t)[:40].sort().values for _ in range(h)])
    other = cache[table[1]].clone()
    compact([cache], table[:1], [(k, v)], kept[None, None], bs)
    k2, v2 = gather_slots(cache, table[:1, torch.arange(40) // bs].long(), (torch.arange(40) % bs)[None])
    for head in range(h):
        assert torch.equal(k2[0, head], key[kept[head], head])
        assert torch.equal(v2[0, head], val[kept[head], head])
    assert torch.equal(cache[table[1]], other)  # another request's blocks are untouched


def test_model_folders_exist():
    assert (smollm2_folder() / "model.safetensors").exists()
    assert os.path.exists(tiny_qwen3_folder() / "config.json")
