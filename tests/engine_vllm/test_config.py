"""Start-up configuration and refusals through vLLM's own ``EngineArgs``, and the CPU cache layout
against vLLM's own cache writer: no engine started. (The settings, the ledger and the paged
compaction themselves are tested without vLLM: tests/test_vllm_*.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvpolicy.vllm.layout import STRIDE_ORDERS, BlockLayout, layer_views  # noqa: E402
from kvpolicy.vllm.models import smollm2_folder, tiny_qwen3_folder  # noqa: E402
from kvpolicy.vllm.paged import compact, gather_paged  # noqa: E402
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved  # noqa: E402


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


# -- start-up through vLLM's own EngineArgs ---------------------------------------------------
def test_engine_config_defaults_and_resolution(tiny):
    cfg = engine_config(tiny, {"policy": "snapkv", "budget": 128})
    assert cfg.cache_config.enable_prefix_caching is True  # vLLM's default: kvpolicy works with it
    # vLLM's own async-scheduling default is kept (its CPU platform turns it off; kvpolicy does not)
    assert cfg.scheduler_config.async_scheduling == engine_config(tiny).scheduler_config.async_scheduling
    assert engine_config(tiny, {"policy": "snapkv"}, async_scheduling=True)  # asked for: not refused
    assert Resolved.from_additional_config(cfg.additional_config).policy().budget == 128


def test_engine_without_kvpolicy_is_untouched(tiny):
    cfg = engine_config(tiny)
    assert "kvpolicy" not in cfg.additional_config
    assert cfg.cache_config.enable_prefix_caching is True  # vLLM's default stays


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
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


def test_accepts_pipeline_parallelism(tiny):
    cfg = engine_config(tiny, {"policy": "snapkv", "budget": 128}, pipeline_parallel_size=2,
                        distributed_executor_backend="mp")
    assert cfg.parallel_config.pipeline_parallel_size == 2


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


# -- the cache layouts against vLLM's own code -------------------------------------------------
def test_layout_table_is_vllms_and_layer_views_have_vllms_strides():
    """``kvpolicy.vllm.layout`` mirrors vLLM's layout enum and its allocation's strides (the fast
    suite's layout tests build their caches with ``layer_views``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, compute_layout_strides

    assert STRIDE_ORDERS == {m.name: m.value for m in KVCacheLayout}
    lyr, nb, h, bs, d = 3, 5, 2, 32, 64
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=d, dtype=torch.float32)
    for member in KVCacheLayout:
        views = layer_views(torch.zeros(lyr * nb * h * bs * 2 * d), member.name, lyr, nb, h, bs, 2 * d)
        layer_stride = views[1].data_ptr() - views[0].data_ptr()  # bytes
        assert views[0].stride(3) == 1  # vLLM counts the content axis in bytes: its stride is 1 byte
        ours = (layer_stride, *(4 * s for s in views[0].stride()[:3]), 1)
        assert ours == compute_layout_strides(spec, nb, lyr, member), member.name


def test_cpu_backend_declares_the_layout_the_adapter_reads():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert [m.name for m in CPUAttentionBackend.supported_kv_cache_layouts()] == ["LBHNC"]
    assert BlockLayout.for_backend(CPUAttentionBackend.get_name(), "LBHNC", 64).interior == "cpu_pages"


def test_compaction_inside_blocks_matches_vllms_cpu_cache_writer():
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    bs, nb, h, d, t = 32, 8, 2, 64, 90
    cache = torch.zeros(nb, h, bs, 2 * d)
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)  # as CPUAttentionBackendImpl views it
    key, val = torch.randn(t, h, d), torch.randn(t, h, d)
    table = torch.tensor([[6, 2, 4], [1, 3, 7]])
    slots = table[0, torch.arange(t) // bs] * bs + torch.arange(t) % bs
    isa = _get_attn_isa(torch.float32, bs, d)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    kv = BlockLayout("LBHNC", "cpu_pages", d).split(cache)
    blocks = table[:1, torch.arange(t) // bs].long()
    k, v = gather_paged(kv, blocks, (torch.arange(t) % bs)[None])
    assert torch.equal(k[0], key.transpose(0, 1)) and torch.equal(v[0], val.transpose(0, 1))
    kept = torch.stack([torch.randperm(t)[:40].sort().values for _ in range(h)])
    other = cache[table[1]].clone()
    compact([kv], table[:1], [(k, v)], kept[None, None], bs)
    k2, v2 = gather_paged(kv, table[:1, torch.arange(40) // bs].long(), (torch.arange(40) % bs)[None])
    for head in range(h):
        assert torch.equal(k2[0, head], key[kept[head], head])
        assert torch.equal(v2[0, head], val[kept[head], head])
    assert torch.equal(cache[table[1]], other)  # another request's blocks are untouched


def test_model_folders_exist():
    assert (smollm2_folder() / "model.safetensors").exists()
    assert os.path.exists(tiny_qwen3_folder() / "config.json")
