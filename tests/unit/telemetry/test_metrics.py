"""verl's fully-async counters and per-version rollouter metrics, computed from plain numbers and samples."""
import pytest

from fully_async.telemetry.metrics import StaleCounter, console_line, rollouter_version_metrics
from fully_async.core.types import Sample, SampleGroup


def group(uid, versions_per_response):
    samples = [Sample(uid=uid, sample_id=f"{uid}-s{j}", prompt_ids=[2], response_ids=[3] * len(v),
                      rollout_log_probs=[-1.0] * len(v), versions=v) for j, v in enumerate(versions_per_response)]
    return SampleGroup(uid, 0, 0, samples, admitted_version=versions_per_response[0][0])


def test_stale_counts_are_cumulative_and_judge_the_version_that_finished_each_response():
    counter = StaleCounter()
    fresh = group("a", [[2, 2], [2]])
    m = counter.add([fresh], trainer_version=2)
    assert m == {"fully_async/count/stale_samples_processed": 0, "fully_async/count/stale_trajectory_processed": 0}
    # a partial response started at version 0 and finished at 2 is not stale at version 2 (verl: version_end)
    mixed = group("b", [[0, 2], [1, 1], [0]])
    m = counter.add([mixed, fresh], trainer_version=2)
    assert m["fully_async/count/stale_trajectory_processed"] == 2
    assert m["fully_async/count/stale_samples_processed"] == 0  # the group finished at version 2
    old = group("c", [[0], [1, 1]])
    m = counter.add([old], trainer_version=3)
    assert m == {"fully_async/count/stale_samples_processed": 1, "fully_async/count/stale_trajectory_processed": 4}


def test_rollouter_version_metrics():
    m = rollouter_version_metrics(version_s=4.0, idle_s=1.0)
    assert m == {"rollouter/version_time": 4.0, "rollouter/active_time": 3.0,
                 "rollouter/idle_ratio": pytest.approx(0.25)}
    assert rollouter_version_metrics(2.0, 5.0)["rollouter/idle_ratio"] == 1.0  # idle counted past the end: capped
    assert rollouter_version_metrics(0.0, 0.0) == {}


def test_console_shows_verls_trainer_idle_ratio():
    line = console_line(3, {"trainer/idle_ratio": 0.25, "fully_async/rollouter/idle_ratio": 0.5})
    assert line == "step 3 | t_idle 0.25 | r_idle 0.5"


def test_console_skips_metrics_it_has_nothing_to_show_for():
    """Per-version metrics (rollouter/*) reach TensorBoard and the trackers, not the console as a bare 'step N'."""
    from fully_async.telemetry.metrics import MetricLogger

    lines = []
    sink = MetricLogger(["console"], "p", "e", write_line=lines.append)
    sink.log({"rollouter/idle_ratio": 0.5, "rollouter/version_time": 1.0}, 4)
    sink.log({"critic/score/mean": 0.25}, 5)
    sink.close()
    assert lines == ["step 5 | reward 0.25"]


def test_the_file_logger_writes_verls_lines_and_never_overwrites_a_run(tmp_path, monkeypatch):
    """trainer.logger `file`, verl's FileLogger: $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl (or
    $VERL_FILE_LOGGER_PATH), a line {"step", "data"} per step, a value that is not finite as null; a new run beside
    an earlier run's file writes <experiment>_2.jsonl, a resumed run appends to the file."""
    import json

    from fully_async.telemetry.metrics import MetricLogger

    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))

    def run(resuming=False, **metrics):
        sink = MetricLogger(["file"], "proj", "exp", resuming=resuming)
        sink.log(metrics, step=1)
        sink.close()
        return sink.trackers[0].path

    first = run(**{"actor/pg_loss": 0.5, "actor/grad_norm": float("nan")})
    assert first == str(tmp_path / "proj" / "exp.jsonl")
    assert [json.loads(line) for line in open(first)] == [{"step": 1, "data": {"actor/pg_loss": 0.5,
                                                                               "actor/grad_norm": None}}]
    assert run(**{"x": 1.0}) == str(tmp_path / "proj" / "exp_2.jsonl")
    assert run(resuming=True, **{"x": 2.0}) == first and len(open(first).read().splitlines()) == 2
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "named.jsonl"))
    assert run(**{"x": 3.0}) == str(tmp_path / "named.jsonl")
