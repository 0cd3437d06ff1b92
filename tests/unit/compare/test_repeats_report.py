"""fully_async/compare: the one report of repeated comparisons (mean and spread of every row, error-bar plots), the
note a CPU comparison opens with, and plots at each step's own end time -- from fake run logs, no run."""
import os

import pytest

from fully_async.compare import repeats
from fully_async.compare.plots import _elapsed
from fully_async.compare.report import summarize_repeats, write_report
from fully_async.compare.runs import Run, read_run
from fully_async.compare.stats import build_table, format_table, shared_cpu_note


def fake_run(mode, device, step_s, tokens=1000.0, trainer=1, rollout=1):
    """Two trainer steps of `step_s` seconds, `tokens` each, written at wall times 10 and 20."""
    rollout = rollout if mode == "async" else 0
    scalars = {"timing_s/step": [(1, 10.0, step_s), (2, 20.0, step_s)],
               "perf/total_num_tokens": [(1, 10.0, tokens), (2, 20.0, tokens)],
               "prompt_length/mean": [(1, 10.0, 10.0), (2, 20.0, 10.0)],
               "response_length/mean": [(1, 10.0, 40.0), (2, 20.0, 40.0)]}
    config = {"mode": mode, "trainer": {"nnodes": 1, "n_gpus_per_node": trainer, "device": device},
              "rollout": {"nnodes": 1, "n_gpus_per_node": rollout}}
    devices = {"trainer": trainer, "rollout": rollout, "total": trainer + rollout, "device": device}
    return Run(f"/runs/{mode}", scalars, 0.0, config, {"devices": devices, "hardware": f"{device} box"})


def pair(device, async_step, sync_step):
    return {"async": fake_run("async", device, async_step), "sync": fake_run("sync", device, sync_step, trainer=2)}


def test_a_cpu_comparison_says_first_that_both_sides_share_the_cores(tmp_path):
    table = build_table(pair("cpu", 4.0, 2.0), 0.8)
    assert table["speedup"]["tokens_per_s"] == pytest.approx(0.5)
    note = table["shared_cpu"]
    assert "2 \"device(s)\"" in note and "same cores" in note and "below 1x" in note
    assert format_table(table).splitlines()[0] == note
    path = write_report(str(tmp_path), table, pair("cpu", 4.0, 2.0), {})
    first = open(path).read().splitlines()[:3]
    assert first[0] == "# Sync vs async comparison" and first[2] == f"> {note}"
    assert build_table(pair("cuda", 1.0, 2.0), 0.8)["shared_cpu"] is None        # accelerators: no note
    assert "4 core(s)" in shared_cpu_note({"async": {"device": "cpu", "total": 2}}, cores=4)
    assert shared_cpu_note({"async": {"device": "cpu", "total": 2}, "sync": {"device": "npu", "total": 2}}) is None


def test_repeats_combine_into_mean_and_spread_per_row():
    tables = [build_table(pair("cuda", a, 2.0), 0.8) for a in (1.0, 2.0, 4.0)]   # async 1000, 500, 250 tok/s
    combined = repeats.combine(tables)
    tps = combined["rows"]["tokens_per_s"]
    assert tps["async"]["mean"] == pytest.approx(583.333, rel=1e-4) and tps["async"]["n"] == 3
    assert tps["async"]["std"] == pytest.approx(381.881, rel=1e-4)                 # sample std (n - 1)
    assert (tps["async"]["min"], tps["async"]["max"]) == (250.0, 1000.0)
    assert tps["sync"] == {"mean": 500.0, "std": 0.0, "min": 500.0, "max": 500.0, "n": 3}
    assert combined["speedup"]["mean"] == pytest.approx((2.0 + 1.0 + 0.5) / 3)
    assert combined["ratio"]["time_per_step_s"]["max"] == pytest.approx(2.0)
    assert "time_to_threshold_s" not in combined["rows"]                           # no validation: no row


def test_the_combined_report_has_every_row_an_error_bar_plot_and_links_each_repeat(tmp_path):
    tables = [build_table(pair("cpu", a, 2.0), 0.8) for a in (3.0, 4.0)]
    dirs = [str(tmp_path / f"repeat_{i}") for i in range(2)]
    path = repeats.write_report(str(tmp_path), tables, summarize_repeats(tables), dirs)
    text = open(path).read()
    lines = text.splitlines()
    assert lines[0] == "# Sync vs async comparison: 2 repeats" and lines[2].startswith("> CPU comparison")
    assert "**0.58x ± 0.12**" in text                                            # 2/3 and 1/2: mean 0.583
    assert ("| tokens/s (total) | 291.7 ± 58.9 (250.0..333.3) | 500.0 ± 0.0 (500.0..500.0) | "
            "0.583 ± 0.118 (0.500..0.667) |") in text                               # 2000 tokens / 2 x 3 or 4 s
    assert "[repeat_1](repeat_1/report.md)" in text and "![repeats](repeats.png)" in text
    assert os.path.getsize(tmp_path / "repeats.png") > 10_000


def test_plots_place_each_step_at_the_time_it_ended_not_when_the_driver_wrote_it(tmp_path, monkeypatch):
    """The driver drains metrics after the fact; each step's scalars carry the time its actor produced them
    (MetricsOutbox._emit), and the TensorBoard event keeps it, so reward_vs_time puts the step at its own end."""
    from fully_async.telemetry.metrics import MetricLogger

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path))
    sink = MetricLogger(["tensorboard"], "p", "e", config={"mode": "async"})
    start = 1_000_000.0
    for step in (1, 2, 3):    # produced 5 s apart, all written now
        sink.log({"critic/score/mean": 0.1 * step, "timing_s/step": 5.0, "perf/total_num_tokens": 10.0}, step,
                 wall_time=start + 5.0 * step)
    sink.close()
    run = read_run(str(tmp_path))
    assert [w for _, w, _ in run.series("critic/score/mean")] == pytest.approx([start + 5.0, start + 10.0,
                                                                                 start + 15.0])
    xs, ys = _elapsed(run, "critic/score/mean")
    assert [b - a for a, b in zip(xs, xs[1:])] == pytest.approx([5.0, 5.0]) and ys == pytest.approx([0.1, 0.2, 0.3])
