"""``benchmarks/vllm_bench.py`` sizes each configuration's KV-cache pool before any engine starts
(``layers_per_block``): every configuration it offers, "full" (the plugin on, no policy) among
them, gets a size, and a per-layer policy's pool counts one block per layer."""

from __future__ import annotations

import pytest
from helpers import load_benchmark

vllm_bench = load_benchmark("vllm_bench")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import Qwen3Config

    folder = tmp_path_factory.mktemp("qwen3")
    Qwen3Config(num_hidden_layers=5, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=97).save_pretrained(folder)
    return str(folder)


def test_every_configuration_gets_a_pool_size(model_folder):
    sizes = {}
    for name, policy in vllm_bench.POLICIES.items():
        if callable(policy):  # built from files (triattention's calibration, quest's pages): not per layer
            continue
        sizes[name] = vllm_bench.layers_per_block(policy, model_folder)
    assert sizes["vllm"] == 1 and sizes["full"] == 1  # "none" is the plugin's no-policy, not a policy to load
    assert sizes["snapkv"] == 1
    assert sizes["pyramidkv"] == 5  # a KV-cache group per layer: one block holds one layer


def test_evicting_stands_for_every_one_tier_evicting_built_in():
    from kvpolicy import available_policies

    names = vllm_bench.expand_configs("vllm,evicting,snapkv")
    assert names[0] == "vllm" and names.count("snapkv") == 1
    assert {"snapkv", "h2o", "pyramidkv", "random-prompt", "tova"} <= set(names)
    assert not {"quest", "oracle-topk", "snapkv-recall", "vase-attnv-recall"} & set(names)  # select mode, two tiers
    assert set(names) - {"vllm"} <= set(available_policies())
    assert vllm_bench.POLICIES["tova"] == {"policy": "tova", "budget": 128}  # a built-in by name, at budget 128


def test_rounds_report_each_configurations_median_and_its_per_round_ratio(capsys):
    runs = [  # three rounds of (a, b), a refusal beside them; a fails in round 0, b in round 2
        {"config": "a", "round": 0, "error": "engine died"},
        {"config": "b", "round": 0, "output_tok_per_s": 10.0, "decode_tok_per_s": 11.0},
        {"config": "c", "round": 0, "error": "refused"},
        {"config": "a", "round": 1, "output_tok_per_s": 100.0, "decode_tok_per_s": 110.0},
        {"config": "b", "round": 1, "output_tok_per_s": 80.0, "decode_tok_per_s": 85.0},
        {"config": "a", "round": 2, "output_tok_per_s": 50.0, "decode_tok_per_s": 55.0},
        {"config": "b", "round": 2, "error": "engine died"},
        {"config": "a", "round": 3, "output_tok_per_s": 50.0, "decode_tok_per_s": 55.0},
        {"config": "b", "round": 3, "output_tok_per_s": 45.0, "decode_tok_per_s": 46.0},
    ]
    vllm_bench.print_medians(runs, "a")
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    # b's ratio is per round, against a's run of the same round (rounds 1 and 3: 0.80 and 0.90; round 0
    # has no a, round 2 no b), then their median: not the ratio of the medians
    assert "x0.850 (rounds: 0.80, 0.90)" in rows["b"] and "| 3 | 45.00 |" in rows["b"]
    assert "x1.000" in rows["a"] and "| 3 | 50.00 | 55.0 |" in rows["a"]
    assert "c" not in rows
