"""The model's facts on vLLM. Without an engine: RoPE read from vLLM 0.32's own rotary embeddings,
vLLM's own Llama giving the transformers facts, an o_proj's weight kept after vLLM's CPU GEMM
dispatch. With engines: the bundled SmolLM2-135M, from the converted folder, served with the
policies that read the model (criticalkv, triattention by name) against the transformers path
(``KVPolicyCache`` + ``generate()``) at a budget that evicts; a calibration for a model of another
shape refused at start-up, and for another model of the same shape per request; criticalkv under
tensor parallelism 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

pytest.importorskip("vllm")

import engine_util  # noqa: E402
from engine_util import (  # noqa: E402
    close,
    first_divergence,
    generate_in_subprocess,
    greedy,
    make_llm,
    serve_beside_a_refused_request,
    tokens_prompt,
    top2_gap,
)

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm.facts import TABLE_ROPES, model_facts  # noqa: E402

BUDGET = 128
NEW = 256
BLOCK = 32
TIE = 1e-4  # two top logits this close are a kernel rounding tie, not a disagreement
PROMPTS = [
    "Write a long story about a dragon who learns to code. Once upon a time",
    "List the numbers from one to two hundred: one, two, three,",
]


def _fake_model(rotary):
    """A model of two layers whose attention modules carry ``rotary`` (``tests/fake_vllm.py``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fake_vllm import layer_names, vllm_model

    model, config = vllm_model(torch.randn(2, 24, 64), kv_heads=2, head_dim=16)
    for m in model.modules():
        if hasattr(m, "rotary_emb"):
            m.rotary_emb = rotary
    return model_facts(model, config, layer_names(2), name="m")


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
], ids=["default", "llama3", "yarn"])
def test_the_facts_rope_is_the_rotation_vllm_applies(params):
    """The facts' RoPE, applied rotate-half, is exactly what vLLM's own ``forward_native`` does to
    queries and keys, for its plain, Llama 3 and YaRN embeddings."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=4096, is_neox_style=True, rope_parameters=params, dtype=torch.float32)
        assert type(rope).__name__ in TABLE_ROPES
        facts = _fake_model(rope)
        assert facts.available == {"rope", "output_projection"}, facts.missing
        pos = torch.arange(0, 4000, 37)
        q, k = torch.randn(len(pos), 2 * 16), torch.randn(len(pos), 16)
        q_rot, k_rot = rope.forward_native(pos, q.clone(), k.clone())
    cos, sin = facts.rope(pos)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(len(pos), -1, 16)
        half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
        return (x * cos[:, None] + half * sin[:, None]).flatten(1)

    torch.testing.assert_close(rotate(q), q_rot, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotate(k), k_rot, rtol=0, atol=1e-6)


def test_an_interleaved_rope_is_missing_with_the_reason():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(16, max_position=64, is_neox_style=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float32)
    assert "is_neox_style False" in _fake_model(rope).why_missing("rope")


KEEP_O_PROJ = """
import tempfile, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from kvpolicy.vllm import hooks, settings
from kvpolicy.vllm.facts import KEPT_WEIGHT, o_proj_weight

hooks.install()
rendezvous = tempfile.mktemp()  # a file, not a port another process could take first
config = VllmConfig(additional_config={settings.KEY: settings.resolve({"policy": "criticalkv"}).to_dict()})
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{rendezvous}")
    initialize_model_parallel(1)
    from vllm.model_executor.layers.linear import RowParallelLinear
    for prefix, kept in (("model.layers.0.self_attn.o_proj", True), ("model.layers.0.mlp.down_proj", False)):
        linear = RowParallelLinear(64, 48, bias=False, prefix=prefix)
        weight = torch.randn(48, 64)
        linear.weight.data.copy_(weight)
        linear.quant_method.process_weights_after_loading(linear)
        assert (KEPT_WEIGHT in linear.__dict__) is kept, prefix
        if kept:
            assert torch.equal(o_proj_weight(linear), weight)
        x = torch.randn(3, 64)
        torch.testing.assert_close(linear(x)[0], x @ weight.t(), rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_an_o_proj_keeps_its_weight_after_vllms_cpu_gemm_dispatch():
    """vLLM's CPU backend packs an unquantised linear's weight and leaves ``weight`` empty; under a
    kvpolicy server the output projection's is kept for the facts (the MLP's is not). In a
    subprocess: it sets up vLLM's tensor-parallel group of one."""
    out = subprocess.run([sys.executable, "-c", KEEP_O_PROJ], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


REAL_LLAMA = """
import sys, tempfile, torch
from transformers import AutoModelForCausalLM
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from kvpolicy.hf.facts import model_facts as hf_facts
from kvpolicy.vllm.facts import model_facts

folder = sys.argv[1]
rendezvous = tempfile.mktemp()  # a file, not a port another process could take first
config = VllmConfig(model_config=ModelConfig(model=folder, dtype="float32"))
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{rendezvous}")
    initialize_model_parallel(1)
    from vllm.model_executor.models.llama import LlamaForCausalLM
    torch.set_default_dtype(torch.float32)
    model = LlamaForCausalLM(vllm_config=config)
hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
    ours.self_attn.o_proj.weight.data.copy_(theirs.self_attn.o_proj.weight)
layers = {i: f"model.layers.{i}.self_attn.attn" for i in range(len(hf.model.layers))}
got, want = model_facts(model, config.model_config.hf_text_config, layers, name=folder), hf_facts(hf)
assert got.available == {"rope", "output_projection"}, got.missing
for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size"):
    assert getattr(got, field) == getattr(want, field), field
pos = torch.arange(0, 8000, 13)
for a, b in zip(got.rope(pos), want.rope(pos), strict=True):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
assert all(torch.equal(got.output_projection(i), want.output_projection(i)) for i in layers)
print("ok")
"""


def test_the_facts_of_vllms_llama_are_the_transformers_facts(model_dir):
    """vLLM's own ``LlamaForCausalLM`` built for SmolLM2-135M (its o_proj weights copied from the
    transformers model): the builder finds every layer's modules, and its facts equal
    ``kvpolicy.hf.model_facts`` (RoPE over 8,000 positions, every output projection). In a
    subprocess, without an engine."""
    out = subprocess.run([sys.executable, "-c", REAL_LLAMA, str(model_dir)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


POLICIES = {
    "criticalkv": ("criticalkv", {"budget": BUDGET}),
    # by name: its bundled calibration (measured on the GGUF package) serves the converted folder,
    # the same model by its fingerprint
    "triattention": ("triattention", {"budget": BUDGET, "recent": 32, "interval": 64}),
}


@pytest.fixture(scope="module")
def model_dir():
    from kvpolicy.vllm.models import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="module")
def hf_refs(model_dir):
    """``KVPolicyCache`` + ``generate()`` (computed before any engine starts: CPUs are few)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = engine_util.hf_model(model_dir)
    ids = [tokenizer(text).input_ids for text in PROMPTS]
    refs = {name: engine_util.hf_references(model, load_policy(source, **overrides), ids, NEW)
            for name, (source, overrides) in POLICIES.items()}
    del model
    return refs


@pytest.mark.parametrize("name", list(POLICIES))
def test_policies_reading_the_model_give_generates_tokens(name, model_dir, hf_refs, tmp_path):
    """Each prompt evicts several times (budget 128 over 256 new tokens); the tokens equal the
    transformers path's, but where both engines' top-2 logits are within a rounding tie."""
    source, overrides = POLICIES[name]
    if isinstance(source, dict):  # a server reads a policy by name or file (mappings are per request only)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(source))
        source = str(path)
    llm = make_llm(model_dir, {"policy": source, **overrides, "trace": str(tmp_path)}, block_size=BLOCK)
    try:
        rows = hf_refs[name]
        outs = llm.generate([tokens_prompt(ids) for ids, _, _ in rows], greedy(NEW, logprobs=2), use_tqdm=False)
    finally:
        close(llm)
    for (ids, ref, margins), out in zip(rows, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        i = first_divergence(got, ref)
        if i is None:
            continue
        gap = top2_gap(out, i)
        assert margins[i] < TIE or gap < TIE, (
            f"{name}, prompt {ids[:8]}...: first divergence at token {i} with top-2 gaps {margins[i]:.2e} (hf), "
            f"{gap:.2e} (vllm)"
        )
    assert len(list(tmp_path.glob("worker-*.jsonl"))) >= 1, "the plugin did not evict"


def test_a_calibration_for_another_model_is_refused_at_start_up():
    """The bundled calibration is SmolLM2-135M's: a server of another model's shape (the tiny
    Qwen3) with TriAttention is refused before any worker starts, with KVPolicyCache's words."""
    from kvpolicy.vllm.models import tiny_qwen3_folder

    with pytest.raises(ValueError, match="calibration .*num_layers = 30, but the model .*tiny-qwen3-0' has 4"):
        make_llm(tiny_qwen3_folder(), {"policy": "triattention", "budget": BUDGET, "recent": 32})


def _random_smollm2(folder):
    """SmolLM2-135M's configuration with random weights (and its tokenizer), in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvpolicy.vllm.models import smollm2_folder

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_folder()), dtype=torch.float32).save_pretrained(
        folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_folder()).save_pretrained(folder)
    return folder


def test_a_request_whose_calibration_is_another_same_shape_models_fails_alone(tmp_path):
    """SmolLM2-135M's shape with other (random) weights: the front end, which has the configuration
    only, passes a request for ``triattention``; the engine core, which has each worker's model
    fingerprint, refuses it alone, and the server goes on."""
    llm = make_llm(_random_smollm2(tmp_path / "smollm2-f32"), {"policy": "none"}, block_size=BLOCK, max_num_seqs=4,
                   processes=True)
    try:
        serve_beside_a_refused_request(llm, {"kvpolicy": "triattention"}, 16)
    finally:
        close(llm)


TP_POLICY = {"policy": "criticalkv", "budget": 32, "recent": 8, "interval": 16, "window": 16}
CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="two tensor-parallel CPU workers need two CPUs")
def test_criticalkv_under_tensor_parallelism_2(tmp_path):
    """The tiny random Qwen3 (2 KV heads) with ``tensor_parallel_size=2``: each rank's value norms
    read its own shard of every o_proj. The tokens of 6 requests equal one rank's, and every
    saved eviction of each rank keeps ``Policy.select`` on its head with the transformers facts."""
    import random

    from transformers import AutoModelForCausalLM

    from kvpolicy.hf.facts import model_facts as hf_facts
    from kvpolicy.vllm.models import tiny_qwen3_folder

    rng = random.Random(7)
    prompts = [[rng.randint(3, 4000) for _ in range(rng.randint(8, 90))] for _ in range(6)]
    tokens = {}
    for tp in (1, 2):
        folder = tmp_path / f"tp{tp}"
        folder.mkdir()
        kwargs: dict = {"tensor_parallel_size": tp}
        env = {}
        if tp == 2:
            kwargs["distributed_executor_backend"] = "mp"
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{CPUS[0]}|{CPUS[1]}"
        tokens[tp] = generate_in_subprocess(folder, tiny_qwen3_folder(), prompts, 96,
                                            {**TP_POLICY, "trace": str(folder / "trace")}, env=env, **kwargs)
    assert tokens[2] == tokens[1]
    facts = hf_facts(AutoModelForCausalLM.from_pretrained(tiny_qwen3_folder(), dtype=torch.float32))
    saved = sorted((tmp_path / "tp2" / "trace").glob("evict-*.pt"))
    assert {p.name.split("-")[1] for p in saved} == {"0", "1"}
    for path in saved:
        rec = torch.load(path)
        assert rec["keys"].shape[1] == 1
        kept = load_policy(rec["policy_yaml"]).select(
            rec["keys"], rec["values"], rec["queries"], query_valid=rec["query_valid"], positions=rec["positions"],
            layer_idx=rec["layer_idx"], evictions=rec["evictions"], seed=rec["seed"], head_offset=rec["head_offset"],
            model=facts,
        )
        assert torch.equal(kept, rec["kept"])
