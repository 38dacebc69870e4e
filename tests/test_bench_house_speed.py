"""benchmarks/bench_house_speed.py's bookkeeping, without a GPU or a subprocess: the processes' order, the ratio per
row (paired by rep, a missing rep left out), the verdict, the figure."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_house_speed",
                                              os.path.join(ROOT, "benchmarks", "bench_house_speed.py"))
bhs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bhs)


def test_processes_alternate_before_and_after():
    assert bhs.plan(2, "abab") == [(0, "before"), (0, "after"), (1, "before"), (1, "after")]
    assert bhs.plan(3, "abba") == [(0, "before"), (0, "after"), (1, "after"), (1, "before"), (2, "before"),
                                   (2, "after")]


def _result(before, after, reps=3):
    rows = [["eager", 1, 4096], ["compiled", 1, 131072]]
    workers = []
    for tree, figures in (("before", before), ("after", after)):
        for rep, ms in enumerate(figures):
            workers.append({"tree": tree, "rep": rep, "rows": [
                {"row": "eager_b1_4096", "ms": ms[0]} if ms[0] is not None else {"row": "eager_b1_4096", "error": "x"},
                {"row": "compiled_b1_131072", "ms": ms[1]}]})
    return {"settings": {"rows": rows, "reps": reps, "dry_run": False}, "workers": workers,
            "trees": {"before": {"commit": "e116c1e"}, "after": {"commit": None}}, "env": {"device": "GPU"}}


def test_ratio_of_medians_and_the_floor():
    res = _result(before=[(10.0, 20.0), (11.0, 20.0), (12.0, 20.0)], after=[(10.0, 21.0), (None, 21.0), (12.2, 20.4)])
    bhs.summarize(res)
    eager, compiled = res["rows"]
    assert eager["before_ms"] == [10.0, 11.0, 12.0] and eager["after_ms"] == [10.0, None, 12.2]
    assert eager["before_median"] == 11.0 and eager["after_median"] == pytest.approx(11.1)
    assert eager["ratio"] == pytest.approx(11.1 / 11.0, abs=1e-4) and eager["within_floor"]
    assert eager["ratio_per_rep"] == [1.0, pytest.approx(12.2 / 12.0, abs=1e-4)]
    assert compiled["ratio"] == pytest.approx(1.05) and compiled["within_floor"] is False
    assert res["verdict"] == "some row slower than the floor"


def test_an_unpaired_row_is_incomplete_and_the_figure_is_written(tmp_path):
    res = _result(before=[(10.0, 20.0)], after=[], reps=2)
    bhs.summarize(res)
    assert [r["ratio"] for r in res["rows"]] == [None, None] and res["verdict"] == "incomplete"
    pytest.importorskip("matplotlib")
    bhs.plot(res, str(tmp_path / "x.png"))
    assert (tmp_path / "x.png").stat().st_size > 0
