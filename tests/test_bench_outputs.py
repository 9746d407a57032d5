"""Benchmark scripts check their outputs and device before the run, not after it: a bad ``--plot``,
``--out`` or ``--device`` is one line (argparse's, exit 2) before any model is built."""

from __future__ import annotations

import pytest
from helpers import load_benchmark


def _refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


def test_decode_bench_checks_its_plot_first(capsys, monkeypatch, tmp_path):
    decode_bench = load_benchmark("decode_bench")
    monkeypatch.setattr(decode_bench, "build_model", lambda: pytest.fail("the run began"))
    assert _refused(capsys, decode_bench.main, ["--plot", str(tmp_path / "nodir" / "x.png")]).endswith(
        f"error: --plot: no such folder: {tmp_path / 'nodir'}")


def test_threshold_bench_checks_its_out_first(capsys, monkeypatch, tmp_path):
    threshold_bench = load_benchmark("threshold_bench")
    monkeypatch.setattr(threshold_bench, "resolve_model", lambda spec: pytest.fail("the run began"))
    assert _refused(capsys, threshold_bench.main, ["--out", str(tmp_path / "nodir" / "t.json")]).endswith(
        f"error: --out: no such folder: {tmp_path / 'nodir'}")
    assert _refused(capsys, threshold_bench.main, ["--out", str(tmp_path)]).endswith(
        f"error: --out: {tmp_path} is a directory")


def test_gpu_check_checks_its_device_and_out_first(capsys, monkeypatch, tmp_path):
    gpu_check = load_benchmark("gpu_check")
    monkeypatch.setattr(gpu_check, "environment", lambda device: pytest.fail("the run began"))
    assert _refused(capsys, gpu_check.main, ["--device", "bogus", "--out", str(tmp_path)]).endswith(
        "error: --device: unknown device 'bogus': give cpu, cuda, cuda:N, mps, xpu or auto")
    a_file = tmp_path / "report"
    a_file.write_text("kept")
    assert _refused(capsys, gpu_check.main, ["--device", "cpu", "--out", str(a_file)]).endswith(
        f"error: --out {a_file}: File exists")
    assert a_file.read_text() == "kept"
