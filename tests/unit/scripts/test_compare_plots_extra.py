"""matplotlib is the `plots` extra, not a core dependency: without it the comparison stops before any run starts,
naming the extra that installs it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from fully_async.compare import __main__ as compare_cli  # noqa: E402
from fully_async.compare import plots  # noqa: E402
from fully_async.compare.runs import CompareError  # noqa: E402


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` raises ImportError


def test_missing_matplotlib_names_the_plots_extra(no_matplotlib):
    with pytest.raises(CompareError, match=r"pip install 'fully_async\[plots\]'"):
        plots.pyplot()


def test_the_comparison_refuses_before_any_run(no_matplotlib, monkeypatch, capsys, tmp_path):
    def must_not_run(*_a, **_k):
        raise AssertionError("a run started without matplotlib")
    monkeypatch.setattr(compare_cli, "run_both", must_not_run)
    rc = compare_cli.main(["--out", str(tmp_path / "out"), "--devices", "1"])
    assert rc == 1
    assert "fully_async[plots]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_with_matplotlib_pyplot_is_the_agg_backend():
    plt = plots.pyplot()
    assert plt.get_backend().lower() == "agg"


def test_the_time_per_step_plot_marks_the_first_step_of_each_weight_version():
    from fully_async.compare.runs import Run
    from fully_async.compare.stats import VERSION_TAG

    def run(versions):
        scalars = {"timing_s/step": [(i + 1, float(i), 5.0 + i) for i in range(len(versions))]}
        if versions[0] is not None:
            scalars[VERSION_TAG] = [(i + 1, float(i), float(v)) for i, v in enumerate(versions)]
        return Run("/x", scalars, 0.0, {})

    series = plots._step_times({"async": run([0, 0, 1, 1, 1, 2]), "sync": run([None] * 6)})
    assert series["async"] == ([1, 2, 3, 4, 5, 6], [5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    steps, seconds, style = series["async: first step of a weight version"]
    assert (steps, seconds) == ([3, 6], [7.0, 10.0]) and style["linestyle"] == "none"
    assert sorted(series) == ["async", "async: first step of a weight version", "sync"]
    # a version that moves every step (nothing inside a version) is not marked
    assert sorted(plots._step_times({"async": run([0, 1, 2, 3, 4, 5])})) == ["async"]
