"""scripts/compare_sync_async.py and scripts/bench_pipeline.py on real short runs of the tiny task.

One module fixture runs the comparison script itself at equal total devices (N=2: async 1 rollout +
1 trainer vs sync on 2 devices, 3 steps each, the bench measured first to choose the split, a
synthetic response-length workload); the tests read its report and re-read its TensorBoard dirs independently and
check the report, the plots, every number of the table, and the refusal of configs that differ beyond
`mode` and placement.  --repeats 2 (both modes twice, the second repeat in the other order, the combined report) is
checked in this process with each repeat's runs replayed from the fixture's real runs (a copy instead of a
subprocess: the repeats' machinery is what is tested, and the fixture's runs are real).  The split/ceiling model
and the report are also tested on synthetic runs.
Slow: the comparison itself, once: the bench and two `python -m fully_async.main` runs, each a subprocess of the
script's own (the --from-logs comparisons and the replayed repeats run in this process).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SCRIPT = os.path.join(ROOT, "scripts", "compare_sync_async.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
MINI, N = 8, 4
OVERRIDES = ["trainer.total_training_steps=3", f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
             f"data.train_batch_size={MINI}", f"actor_rollout_ref.rollout.n={N}",
             f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * N}", "trainer.progress_bar=false",
             "trainer.test_freq=1", "trainer.device=cpu", "benchmark.response_length=lognormal"]
PLOTS = ["throughput", "reward_vs_time", "val_reward_vs_time", "reward_vs_samples", "time_per_step", "idle_ratios",
         "staleness"]
VAL_TAG = "val-core/arithmetic/reward/mean@1"
PLACEMENT = {"async": (1, 1, "fsdp"), "sync": (0, 2, "fsdp2")}  # rollout, trainer devices, strategy


def run_script(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def in_process(capsys, *args):
    """`python -m fully_async.compare ARGS` in this process (what the script runs; ~3 s of start-up and imports
    saved per call): its return code and what it printed, as run_script gives them."""
    from types import SimpleNamespace

    from fully_async.compare.__main__ import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)


def read_events(logdir):
    """tag -> [(step, wall_time, value)] and the first event's wall time, straight from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.wall_time, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return scalars, acc.FirstEventTimestamp()


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """ONE invocation serves every test: the bench, then both modes (--repeats 1).  Returns the comparison's
    folder, its stdout and the folder of its async/sync pair (runs/, table.json, report.md: the same folder)."""
    out = tmp_path_factory.mktemp("compare")
    r = run_script("--out", str(out), "--threshold", "0.0", "--bench-batches", "1", "--repeats", "1", *OVERRIDES)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out, r.stdout, out


def test_repeats_report_median_and_spread(compared, tmp_path, capsys, monkeypatch):
    """--repeats 2: both modes twice (the second repeat runs sync first), one report per repeat, and the
    median/min/max/spread of each headline figure in repeats.json and on stdout, and the combined report.  The
    script's own code in this process, its saved bench and each run's subprocess a copy of the fixture's real run
    of that mode (driver._stream runs `cp` instead of `python -m fully_async.main`)."""
    from fully_async.compare import driver

    real_stream, source = driver._stream, compared[2]
    copied = []

    def replay(name, cmd, out_dir, env):   # the run `name` writes its TensorBoard dir: the fixture's run of it
        assert cmd[1:3] == ["-m", "fully_async.main"] and f"mode={name}" in cmd, cmd
        copied.append(name)
        os.makedirs(os.path.dirname(env["TENSORBOARD_DIR"]), exist_ok=True)
        real_stream(name, ["cp", "-r", str(source / "runs" / name), env["TENSORBOARD_DIR"]], out_dir, env)

    monkeypatch.setattr(driver, "_stream", replay)
    out = tmp_path / "repeats"
    r = in_process(capsys, "--out", str(out), "--threshold", "0.0", "--bench-json", str(source / "bench.json"),
                   "--repeats", "2", *OVERRIDES)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    stdout = r.stdout
    assert sorted(copied) == ["async", "async", "sync", "sync"]
    summary = json.loads((out / "repeats.json").read_text())
    assert summary["repeats"] == 2
    speed = summary["figures"]["speedup async/sync"]
    assert len(speed["values"]) == 2 and speed["min"] <= speed["median"] <= speed["max"]
    for i in range(2):
        assert (out / f"repeat_{i}" / "report.md").is_file()
        assert {p.name for p in (out / f"repeat_{i}" / "runs").iterdir()} == {"async", "sync"}
    order = [line.split(":")[0].removeprefix("=== ") for line in stdout.splitlines()
             if line.startswith(("=== async:", "=== sync:"))]
    # each repeat runs both modes, the second in the other order than the first
    assert sorted(order[:2]) == ["async", "sync"] and order[2:] == order[:2][::-1] and "over 2 repeats" in stdout
    combined = (out / "report.md").read_text()
    assert "# Sync vs async comparison: 2 repeats" in combined and "](repeat_1/report.md)" in combined


def placement_of(cfg):
    return (cfg["rollout"]["n_gpus_per_node"] if cfg["mode"] == "async" else 0, cfg["trainer"]["n_gpus_per_node"],
            cfg["actor_rollout_ref"]["actor"]["strategy"])


def test_runs_differ_only_in_mode_and_placement(compared):
    top, stdout, out = compared
    cfg = {m: json.loads((out / "runs" / m / "config.json").read_text()) for m in ("async", "sync")}
    assert cfg["async"]["mode"] == "async" and cfg["sync"]["mode"] == "sync"
    assert {m: placement_of(c) for m, c in cfg.items()} == PLACEMENT
    for c in cfg.values():   # the rest is identical, except where each mode writes (its default experiment name)
        c["mode"], c["trainer"]["n_gpus_per_node"], c["actor_rollout_ref"]["actor"]["strategy"] = "x", 0, "x"
        c["trainer"]["experiment_name"] = c["trainer"]["default_local_dir"] = "x"
    cfg["async"]["rollout"]["n_gpus_per_node"] = cfg["sync"]["rollout"]["n_gpus_per_node"]
    from fully_async.compare.runs import async_only_keys, flatten  # keys a sync run does not read may differ

    flat = {m: {k: v for k, v in flatten(c).items() if k not in async_only_keys()} for m, c in cfg.items()}
    assert flat["async"] == flat["sync"]
    assert "tokens/s (total)" in stdout and "speedup async/sync" in stdout
    assert "total devices: 2 cpu per mode (equal)" in stdout and "<- chosen" in stdout
    assert "synthetic response lengths: lognormal(median 2 = 0.25 x 8, sigma 0.75)" in stdout
    bench = json.loads((top / "bench.json").read_text())   # the split was chosen from a measured bench
    assert bench["workload"]["kind"] == "lognormal" and bench["rollout"]["tokens_per_s"] > 0


def test_ceilings_and_efficiency_of_the_split(compared, tmp_path, capsys):
    _, _, out = compared
    table = json.loads((out / "table.json").read_text())
    R, T = table["bench"]["rollout"]["tokens_per_s"], table["bench"]["train"]["tokens_per_s"]
    split = table["split"]
    assert (split["devices"], split["rollout"], split["trainer"], split["forced"]) == (2, 1, 1, False)
    assert [c["rollout"] for c in split["candidates"]] == [1]
    a, s = table["modes"]["async"], table["modes"]["sync"]
    assert a["ceiling_tokens_per_s"] == pytest.approx(min(R, T)) == split["ceiling"]
    assert s["ceiling_tokens_per_s"] == pytest.approx(1 / (1 / (2 * R) + 1 / (2 * T))) == split["sync_ceiling"]
    for st in (a, s):
        assert st["pipeline_efficiency"] == pytest.approx(st["tokens_per_s"] / st["ceiling_tokens_per_s"])
    assert table["fair"] and table["devices_total"] == {"async": 2, "sync": 2}
    assert table["workload"]["expected"]["p50"] == 2
    report = (out / "report.md").read_text()
    assert "candidate splits of N=2 devices" in report and "why: r=1 maximises" in report
    assert f"= {s['ceiling_tokens_per_s']:.1f} tokens/s (efficiency {s['pipeline_efficiency']:.3f})" in report
    # from saved logs with --bench: the async run's split among the candidates, e on the 2-device sync trainer
    r = in_process(capsys, "--from-logs", str(out / "runs" / "async"), str(out / "runs" / "sync"),
                   "--out", str(tmp_path), "--bench", "--bench-batches", "1", "--dp-efficiency", "0.5")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    again = json.loads((tmp_path / "table.json").read_text())
    R, T = again["bench"]["rollout"]["tokens_per_s"], again["bench"]["train"]["tokens_per_s"]
    assert again["split"]["reason"].startswith("the async run's split 1+1: predicted")
    assert again["modes"]["async"]["ceiling_tokens_per_s"] == pytest.approx(min(R, T))
    assert again["modes"]["sync"]["ceiling_tokens_per_s"] == pytest.approx(1 / (1 / (2 * R) + 1 / (2 * T * 0.5)))


def test_from_logs_report_plots_and_numbers(compared, tmp_path, capsys):
    _, _, out = compared
    a_dir, s_dir = str(out / "runs" / "async"), str(out / "runs" / "sync")
    events = {"async": read_events(a_dir), "sync": read_events(s_dir)}
    # a threshold some but not necessarily all validation points reach
    all_vals = sorted(v for m in events for _, _, v in events[m][0][VAL_TAG])
    threshold = all_vals[len(all_vals) // 2]
    dest = tmp_path / "report"
    r = in_process(capsys, "--from-logs", s_dir, a_dir, "--out", str(dest), "--threshold", str(threshold))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = (dest / "report.md").read_text()
    summary = json.loads((out / "runs" / "async" / "summary.json").read_text())
    assert summary["hardware"] and f"Hardware: {summary['hardware']}" in report
    assert "- async: 2 cpu device(s) (trainer 1, rollout 1, strategy torch)" in report
    assert "- sync: 2 cpu device(s) (trainer 2, rollout 0, colocated, strategy fsdp2)" in report
    assert "Placement keys allowed to differ at equal total devices" in report
    assert "- `trainer.n_gpus_per_node`: async `1` vs sync `2` (placement)" in report
    assert "synthetic response lengths: lognormal" in report
    for name in PLOTS:
        png = dest / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name}.png)" in report

    table = json.loads((dest / "table.json").read_text())
    assert table["config_diff"] == [["actor_rollout_ref.actor.strategy", "torch", "fsdp2"],
                                    ["trainer.n_gpus_per_node", 1, 2]]
    assert table["fair"] and table["split"] is None and table["bench"] is None   # no --bench: no ceilings
    for mode in ("async", "sync"):
        scalars, first = events[mode]
        got = table["modes"][mode]
        step_s = [v for _, _, v in scalars["timing_s/step"]]
        tokens = [v for _, _, v in scalars["perf/total_num_tokens"]]
        assert got["steps"] == len(step_s) == 3
        assert got["devices"]["total"] == 2 and got["pipeline_efficiency"] is None
        assert got["tokens_per_s"] == pytest.approx(sum(tokens) / sum(step_s), rel=1e-9)
        assert got["tokens_per_s_per_device"] == pytest.approx(sum(tokens) / sum(step_s) / 2, rel=1e-9)
        assert got["time_per_step_s"] == pytest.approx(sum(step_s) / 3, rel=1e-9)
        assert got["samples_per_s"] == pytest.approx(3 * MINI * N / sum(step_s), rel=1e-9)
        vals = sorted(scalars[VAL_TAG], key=lambda e: e[1])
        assert got["val_final"] == pytest.approx(vals[-1][2])
        assert got["val_best"] == pytest.approx(max(v for _, _, v in vals))
        hit = next((w for _, w, v in vals if v >= threshold), None)
        if hit is None:
            assert got["time_to_threshold_s"] is None
        else:
            assert got["time_to_threshold_s"] == pytest.approx(hit - first, abs=1e-3)
        for key, tag in (("trainer_idle_ratio", "trainer/idle_ratio"),
                         ("rollouter_idle_ratio", "fully_async/rollouter/idle_ratio"),
                         ("staleness_mean", "fully_async/staleness/mean")):
            vs = [v for _, _, v in scalars[tag]]
            assert got[key] == pytest.approx(sum(vs) / len(vs), rel=1e-6), key
    ratio = table["modes"]["async"]["tokens_per_s"] / table["modes"]["sync"]["tokens_per_s"]
    assert table["speedup"]["tokens_per_s"] == pytest.approx(ratio)
    assert f"{table['modes']['async']['tokens_per_s']:.1f}" in r.stdout


def _edit(run_dir, fn, name="config.json"):
    path = run_dir / name
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_config_diff_beyond_mode_and_placement_is_refused(compared, tmp_path, capsys):
    _, _, out = compared
    a_dir, s_dir = tmp_path / "async", tmp_path / "sync"
    shutil.copytree(out / "runs" / "async", a_dir)
    shutil.copytree(out / "runs" / "sync", s_dir)
    _edit(s_dir, lambda c: c["actor_rollout_ref"]["actor"]["optim"].update(lr=0.5))
    r = in_process(capsys, "--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "refused"))
    assert r.returncode == 2, r.stdout + r.stderr
    named = [line.split(":")[0].strip() for line in r.stderr.splitlines() if line.startswith("  ")]
    assert named == ["actor_rollout_ref.actor.optim.lr"], r.stderr   # the placement keys are not named
    assert not (tmp_path / "refused" / "report.md").exists()
    # a deliberate difference is accepted when named, and the report states it
    r = in_process(capsys, "--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "allowed"),
                   "--allow-diff", "actor_rollout_ref.actor.optim.lr")
    assert r.returncode == 0, r.stdout + r.stderr
    lr = json.loads((a_dir / "config.json").read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"]
    report = (tmp_path / "allowed" / "report.md").read_text()
    assert f"`actor_rollout_ref.actor.optim.lr`: async `{lr}` vs sync `0.5` (allowed by --allow-diff)" in report
    # placement may differ only at equal total devices
    _edit(s_dir, lambda c: c["actor_rollout_ref"]["actor"]["optim"].update(lr=lr))
    _edit(s_dir, lambda c: c["trainer"].update(n_gpus_per_node=3))
    _edit(s_dir, lambda s: s["devices"].update(trainer=3, total=3), "summary.json")
    r = in_process(capsys, "--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "unequal"))
    assert r.returncode == 2 and "at equal total devices; these runs use async 2 vs sync 3" in r.stderr, r.stderr
    assert [line.split(":")[0].strip() for line in r.stderr.splitlines() if line.startswith("  ")] == [
        "actor_rollout_ref.actor.strategy", "trainer.n_gpus_per_node"]
    # identical configs on unequal devices (the old async 1+1 vs sync 1) still compare, flagged as unequal
    _edit(s_dir, lambda c: (c["trainer"].update(n_gpus_per_node=1), c["actor_rollout_ref"]["actor"].update(
        strategy="torch")))
    _edit(s_dir, lambda s: s["devices"].update(trainer=1, total=1), "summary.json")
    r = in_process(capsys, "--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "legacy"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "total devices DIFFER: async 2, sync 1" in (tmp_path / "legacy" / "report.md").read_text()
    # two runs of the same mode, a mode override or bad placement flags are refused before anything runs
    assert in_process(capsys, "--from-logs", str(a_dir), str(a_dir), "--out", str(tmp_path / "x")).returncode == 2
    for args, words in ((["mode=sync"], "mode="),   # (--devices 1 now compares sync with colocated async)
                        (["--split", "2"], "--split 2 must be in 1..1"), (["--split", "0"], "--split 0 must be"),
                        (["--dp-efficiency", "1.5"], "--dp-efficiency 1.5"), (["--repeats", "0"], "--repeats 0"),
                        (["rollout.n_gpus_per_node=2"], "pass --split R"),
                        (["trainer.nnodes=2"], "trainer.nnodes=2"),
                        (["--devices", "3", "trainer.n_gpus_per_node=2"], "contradicts --devices 3")):
        r = in_process(capsys, "--out", str(tmp_path / "x"), *args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)
    assert not (tmp_path / "x" / "runs").exists()


def test_bench_pipeline_measures_both_stages(tmp_path):
    import torch

    import bench_pipeline

    threads = torch.get_num_threads()
    # placement and fsdp2 of the overrides are ignored: the bench measures one device per stage
    path = tmp_path / "bench.json"
    assert bench_pipeline.main(["--batches", "1", "--out", str(path), "--devices", "3",
                                f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
                                f"actor_rollout_ref.rollout.n={N}", "trainer.device=cpu",
                                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * N}",
                                "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2",
                                "benchmark.response_length=lognormal",
                                "benchmark.response_length_median_ratio=0.125"]) == 0
    res = json.loads(path.read_text())
    assert torch.get_num_threads() == threads   # the 1-thread setting does not leak
    assert res["threads"] == 1 and res["device"] == "cpu"
    for stage in ("rollout", "train"):
        assert res[stage]["tokens_per_s"] > 0 and res[stage]["seconds"] > 0
        assert res[stage]["samples"] == MINI * N
    assert res["rollout"]["tokens"] == res["train"]["tokens"] > MINI * N   # same samples, prompt + response
    assert res["min_tokens_per_s"] == min(res["rollout"]["tokens_per_s"], res["train"]["tokens_per_s"])
    assert res["workload"]["median"] == 1.0 and "ONE device" in res["per_device"]
    table = bench_pipeline.format_table(res)
    assert "rollout-only" in table and "synthetic response lengths: lognormal(median 1 = 0.125 x 8" in table
    assert [c["rollout"] for c in res["split"]["candidates"]] == [1, 2]   # --devices 3: the splits of 3 devices


# ----------------------------------------------------------------------------------- split model (no runs)
def test_choose_split_maximises_the_async_ceiling():
    from bench_pipeline import choose_split, sync_ceiling

    s = choose_split(8, rollout_tps=100.0, train_tps=30.0, dp_efficiency=0.9)
    # r x 100 vs k x 30 x 0.9^log2(k), k = 8 - r trainer devices (0.9 kept per doubling): r=2 gives
    # min(200, 6 x 30 x 0.9^2.585 = 137.1), the best; 4 trainer devices are worth 4 x 0.81, 2 are worth 2 x 0.9
    assert [round(c["ceiling"], 6) for c in s["candidates"]] == [100, 137.08537, 117.448008, 97.2, 76.158539, 54, 30]
    assert (s["rollout"], s["trainer"], s["best"], s["ceiling"]) == (2, 6, 2, pytest.approx(137.08537))
    assert s["candidates"][-1]["train_tokens_per_s"] == 30.0   # one trainer device: no data-parallel loss
    assert s["sync_ceiling"] == pytest.approx(1 / (1 / 800 + 1 / (8 * 30 * 0.9 ** 3)))
    assert s["sync_ceiling"] == pytest.approx(sync_ceiling(8, 100.0, 30.0, 0.9))
    assert "r=2 maximises" in s["reason"] and not s["forced"]
    tie = choose_split(4, 100.0, 100.0)   # r=2: min(200, 200); ties go to fewer rollout devices
    assert tie["rollout"] == 2
    tie = choose_split(3, 100.0, 50.0)    # r=1: min(100, 100), r=2: min(200, 50)
    assert tie["rollout"] == 1 and tie["ceiling"] == 100.0
    even = choose_split(5, 10.0, 10.0)    # r=2: min(20, 30) = 20 = r=3: min(30, 20)
    assert even["rollout"] == 2 and "tied with r=3" in even["reason"]
    forced = choose_split(4, 100.0, 100.0, force=3)
    assert (forced["rollout"], forced["ceiling"], forced["best"], forced["forced"]) == (3, 100.0, 2, True)
    assert forced["reason"].startswith("forced by --split 3: predicted 100.0 tokens/s; the best split: r=2")
    blind = choose_split(4, None, None, force=1)
    assert (blind["rollout"], blind["trainer"], blind["candidates"], blind["ceiling"]) == (1, 3, [], None)


@pytest.mark.parametrize("args, words", [
    ((1, 10.0, 10.0), "--devices 1"), ((4, 10.0, 10.0, 1.0, 4), "--split 4 must be in 1..3"),
    ((4, 10.0, 10.0, 1.0, 0), "--split 0"), ((4, 10.0, 10.0, 0.0), "--dp-efficiency 0.0"),
    ((4, None, None), "needs the measured"),
])
def test_choose_split_rejects_bad_flags(args, words):
    from bench_pipeline import choose_split

    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        choose_split(*args)


def test_plan_devices_and_mode_overrides():
    from fully_async.compare import __main__ as cs

    assert cs.plan_devices(["a=1"], None) == (2, ["a=1"])
    assert cs.plan_devices(["trainer.n_gpus_per_node=4", "a=1"], None) == (4, ["a=1"])
    assert cs.plan_devices(["trainer.nnodes=1"], 6) == (6, [])
    assert cs.mode_overrides("sync", 4, 1, []) == ["trainer.n_gpus_per_node=4",
                                                   "actor_rollout_ref.actor.strategy=fsdp2"]
    assert cs.mode_overrides("async", 4, 3, []) == ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=3"]
    assert cs.mode_overrides("async", 4, 1, ["actor_rollout_ref.actor.strategy=megatron"]) == [
        "trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=1"]   # the user's strategy is kept


def fake_run(mode, trainer, rollout, strategy, tps, log_dir="/x"):
    """A Run with 2 steps of 1000 tokens each at 1000 / tps seconds per step, two validations."""
    from fully_async.compare.runs import Run

    step = 1000.0 / tps
    scalars = {"timing_s/step": [(1, 10.0, step), (2, 20.0, step)],
               "perf/total_num_tokens": [(1, 10.0, 1000.0), (2, 20.0, 1000.0)],
               "prompt_length/mean": [(1, 10.0, 5.0), (2, 20.0, 5.0)],
               "response_length/mean": [(1, 10.0, 5.0), (2, 20.0, 5.0)],
               "critic/score/mean": [(1, 10.0, 0.1), (2, 20.0, 0.3)],
               VAL_TAG: [(0, 5.0, 0.1), (2, 21.0, 0.5)]}
    config = {"mode": mode, "trainer": {"nnodes": 1, "n_gpus_per_node": trainer, "device": "cuda"},
              "rollout": {"nnodes": 1, "n_gpus_per_node": max(1, rollout)},
              "actor_rollout_ref": {"actor": {"strategy": strategy}}, "data": {"max_response_length": 512},
              "benchmark": {"response_length": "lognormal", "response_length_median_ratio": 0.25,
                            "response_length_sigma": 0.75, "seed": 0}}
    devices = {"trainer": trainer, "rollout": rollout, "total": trainer + rollout, "device": "cuda"}
    return Run(log_dir, scalars, 0.0, config, {"devices": devices, "hardware": "H100 x4", "wall_s": 30.0})


def test_report_of_synthetic_runs_states_split_ceilings_and_workload(tmp_path):
    from bench_pipeline import choose_split
    from fully_async.compare.stats import build_table, format_table
    from fully_async.compare.runs import check_diff, config_diff
    from fully_async.compare.report import write_report

    runs = {"async": fake_run("async", 3, 1, "fsdp2", 250.0), "sync": fake_run("sync", 4, 0, "fsdp2", 160.0)}
    bench = {"rollout": {"tokens_per_s": 300.0}, "train": {"tokens_per_s": 100.0}, "device": "cuda", "threads": None}
    split = choose_split(4, 300.0, 100.0)
    assert (split["rollout"], split["ceiling"]) == (1, 300.0)   # min(300, 300)
    diff = config_diff(runs["async"].config, runs["sync"].config)
    assert check_diff(diff, (), {"async": 4, "sync": 4}) == ([], True)
    assert [d[0] for d in check_diff(diff, (), {"async": 4, "sync": 3})[0]] == ["trainer.n_gpus_per_node"]
    table = build_table(runs, 0.4, bench, diff, split)
    a, s = table["modes"]["async"], table["modes"]["sync"]
    assert a["tokens_per_s"] == pytest.approx(250.0) and a["ceiling_tokens_per_s"] == pytest.approx(300.0)
    assert a["pipeline_efficiency"] == pytest.approx(250 / 300)
    assert s["ceiling_tokens_per_s"] == pytest.approx(1 / (1 / 1200 + 1 / 400)) == pytest.approx(300.0)
    assert s["pipeline_efficiency"] == pytest.approx(160 / 300)
    assert table["speedup"]["tokens_per_s"] == pytest.approx(250 / 160)
    assert table["placement_diff"] == ["trainer.n_gpus_per_node"]
    assert table["workload"]["expected"]["p50"] == 128
    text = format_table(table)
    for line in ("total devices: 4 cuda per mode (equal)", "async: rollout 1 + trainer 3 device(s), strategy fsdp2",
                 "sync: 4 device(s), colocated", "candidate splits of N=4 devices (R = 300.0, T = 100.0",
                 "why: r=1 maximises", "synthetic response lengths: lognormal(median 128 = 0.25 x 512, sigma 0.75)",
                 "speedup async/sync: tokens/s 1.56x"):
        assert line in text, line
    write_report(str(tmp_path), table, runs, {})
    report = (tmp_path / "report.md").read_text()
    assert "min(1 R, 3 T e) = 300.0 tokens/s (efficiency 0.833)" in report
    assert "1 / (1/(4 R) + 1/(4 T e)) = 300.0 tokens/s (efficiency 0.533)" in report
    assert "- `trainer.n_gpus_per_node`: async `3` vs sync `4` (placement)" in report
    assert "P(hit max) 3.2%" in report and "**1.56x**" in report


CORE_METRICS = ["perf/throughput", "perf/time_per_step", "perf/total_num_tokens", "timing_s/gen",
                "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/param_sync",
                "timing_s/step", "fully_async/count/total_generated_samples", "fully_async/count/current_param_version",
                "trainer/idle_ratio", "fully_async/rollouter/idle_ratio", "rollouter/idle_ratio",
                "rollouter/active_time", "rollouter/version_time", "fully_async/count/stale_samples_processed",
                "fully_async/count/stale_trajectory_processed", "fully_async/partial/total_partial_num",
                "fully_async/partial/partial_ratio",
                "fully_async/partial/max_partial_span", "fully_async/staleness/mean", "actor/pg_loss",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
                "critic/score/mean", "response_length/mean", "response_length/max", "response_length/clip_ratio",
                VAL_TAG]


def test_sync_logs_the_same_metric_set_as_async(compared):
    _, _, out = compared
    tags = {m: set(read_events(str(out / "runs" / m))[0]) for m in ("async", "sync")}
    for mode in ("async", "sync"):
        assert not [m for m in CORE_METRICS if m not in tags[mode]], mode
    # colocation is visible in sync mode: per-phase memory and the switch timings
    assert {"memory/generate/host_rss_gib", "memory/update_actor/host_rss_gib", "timing_s/offload",
            "timing_s/onload"} <= tags["sync"]
    sync_versions = read_events(str(out / "runs" / "sync"))[0]["fully_async/staleness/max"]
    assert [v for _, _, v in sync_versions] == [0.0, 0.0, 0.0]   # every sync sample is on-policy
    sync_stale = read_events(str(out / "runs" / "sync"))[0]["fully_async/count/stale_trajectory_processed"]
    assert [v for _, _, v in sync_stale] == [0.0, 0.0, 0.0]
