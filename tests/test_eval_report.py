"""What a reader of a run sees: plots that tell the policies apart, and an honest ETA."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from kvpolicy.eval.metrics.base import Column
from kvpolicy.eval.progress import LineBars, PairEta
from kvpolicy.eval.report import _EtaColumn, off_scale, write_plots

# docs/findings.md, budgets 96 / 128 (the full cache: PPL / full 1.0, agreement 1.0, KV MiB 11.91).
PPL_RATIO = {
    "snapkv": [1.049, 1.002], "rkv": [1.038, 1.022], "curdkv": [1.098, 1.048], "vase-dkv": [1.070, 1.038],
    "vase-attnv": [1.056, 1.012], "streamingllm": [1.065, 1.013], "evict-large-range": [1.209, 1.139],
    "random": [2.288, 1.803], "oracle-topk": [1.004, 1.002], "quest": [1.080, 1.046],
    "vase-attnv@select": [1.041, 1.006],
}
AGREEMENT = {
    "snapkv": [0.914, 0.984], "rkv": [0.828, 0.883], "curdkv": [0.922, 0.930], "vase-dkv": [0.914, 0.938],
    "vase-attnv": [0.922, 0.961], "streamingllm": [0.930, 0.953], "evict-large-range": [0.914, 0.930],
    "random": [0.914, 0.938], "oracle-topk": [0.992, 1.000], "quest": [0.852, 0.945],
    "vase-attnv@select": [0.750, 0.945],
}
KV_MIB = {
    "snapkv": [9.93, 12.79], "rkv": [10.52, 11.95], "curdkv": [9.93, 12.79], "vase-dkv": [9.93, 12.79],
    "vase-attnv": [9.93, 12.79], "streamingllm": [5.71, 8.57], "evict-large-range": [9.93, 12.79],
    "random": [9.93, 12.79], "oracle-topk": [45.83, 45.86], "quest": [48.65, 48.67],
    "vase-attnv@select": [49.99, 50.01],
}


def test_a_policy_that_squeezes_the_others_goes_off_the_zoomed_scale():
    # random's 2.29 would squeeze the ten others (1.00-1.21) into a sixth of the axis.
    assert off_scale(PPL_RATIO, 1.0) == ["random"]
    # 0.75-1.00 reads well on one axis: no zoom, even though the worst are far below the best.
    assert off_scale(AGREEMENT, 1.0) == []
    # The selection policies hold the whole cache: the evicting ones' differences need a zoom.
    assert off_scale(KV_MIB, 11.91) == ["vase-attnv@select", "quest", "oracle-topk"]
    # Both sides at once; never more than a third of the policies; nothing to zoom on a flat plot.
    both = {"lo": [-10.0], "a": [1.0], "b": [1.05], "c": [1.02], "d": [1.03], "e": [1.01], "hi": [10.0]}
    assert sorted(off_scale(both, 1.0)) == ["hi", "lo"]
    assert off_scale({"a": [1.0], "b": [1.1], "x": [9.0]}, None) == ["x"]
    assert off_scale({"a": [1.0], "x": [9.0]}, None) == []
    assert off_scale({"a": [2.0], "b": [2.0], "c": [2.0]}, 2.0) == []


def test_plots_get_a_zoomed_panel_only_when_a_policy_is_off_scale(tmp_path):
    from matplotlib.image import imread

    def rows(values: dict[str, list[float]], ref: float) -> list[dict]:
        out = [{"key": "full", "policy": "full", "budget": None, "values": {"x": ref}}]
        for name, vs in values.items():
            out += [{"key": f"{name}@{b}", "policy": name, "budget": b, "values": {"x": v}}
                    for b, v in zip((96, 128), vs, strict=True)]
        return out

    col = [Column("x", "PPL / full", "{:.3f}", "lower")]
    (zoomed,) = write_plots(tmp_path / "zoomed", col, rows(PPL_RATIO, 1.0))
    (single,) = write_plots(tmp_path / "single", col, rows(AGREEMENT, 1.0))
    assert zoomed.name == single.name == "x.png"
    # Two panels side by side (and one legend) against one panel and the legend.
    assert imread(zoomed).shape[1] > 1.4 * imread(single).shape[1]


def test_the_eta_weighs_pairs_by_what_pairs_like_them_took():
    eta = PairEta([("full", "full", "full"), ("a@96", "a", "evict"), ("s@96", "s", "select"),
                   ("a@128", "a", "evict"), ("s@128", "s", "select")])
    assert eta.text() is None  # nothing timed yet
    eta.done("full", 10.0)
    # Nothing of either kind timed: the full cache's 10 s, weighed (a selection pair ~6 evicting ones).
    assert eta.remaining() == (10 + 60 + 10 + 60, ["evict", "select"])
    assert eta.text() == "~2m20s (no evicting or selection pair timed yet)"
    eta.done("a@96", 20.0)
    assert eta.remaining() == (20 + 2 * 6 * 15, ["select"])  # a@128 as a@96; s from the mean unit
    eta.done("s@96", 300.0)
    # Every kind timed: 20 s + 300 s left. Counting every pair alike would say 330 / 3 x 2 = 220 s.
    assert eta.remaining() == (320.0, [])
    assert eta.text() == "5m20s"
    eta.done("a@128", 21.0)
    eta.done("s@128", 290.0)
    assert eta.text() == "0s"
    with pytest.raises(ValueError, match="unknown kind"):
        PairEta([("x", "x", "prefill")])


def test_progress_lines_and_bars_show_the_runners_eta():
    out = io.StringIO()
    console = SimpleNamespace(print=lambda line, **_: out.write(line + "\n"))
    bars = LineBars(console)
    task = bars.add_task("pairs", total=4)
    bars.update(task, description="full")
    bars.advance(task)  # no estimate given: the line's own, pairs counted alike
    bars.update(task, description="snapkv@96", eta="~4m10s (no selection pair timed yet)")
    bars.advance(task)
    bars.update(task, description="quest@96", eta=None)  # the runner cannot tell yet: no ETA
    bars.advance(task)
    first, second, third = out.getvalue().splitlines()
    assert "[1/4] full done in" in first and ", ETA " in first
    assert second.endswith("ETA ~4m10s (no selection pair timed yet)")
    assert "ETA" not in third
    assert str(_EtaColumn().render(SimpleNamespace(fields={"eta": "3m"}))) == "ETA 3m"
    assert str(_EtaColumn().render(SimpleNamespace(fields={}))) == ""
