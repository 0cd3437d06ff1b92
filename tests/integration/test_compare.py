"""scripts/compare_sync_async.py and scripts/bench_pipeline.py on real short runs of the tiny task.

One module fixture runs the comparison script itself (async then sync, 3 steps each, identical
overrides); the tests then re-read those TensorBoard dirs independently and check the report,
the plots, every number of the table, and the refusal of configs that differ beyond `mode`.
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
MINI, N = 8, 4
OVERRIDES = ["trainer.total_training_steps=3", f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
             f"data.train_batch_size={MINI}", f"actor_rollout_ref.rollout.n={N}",
             f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * N}", "trainer.progress_bar=false",
             "trainer.test_freq=1", "trainer.device=cpu"]
PLOTS = ["throughput", "reward_vs_time", "val_reward_vs_time", "reward_vs_samples", "time_per_step", "idle_ratios",
         "staleness"]
VAL_TAG = "val-core/arithmetic/reward/mean@1"


def run_script(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def read_events(logdir):
    """tag -> [(step, wall_time, value)] and the first event's wall time, straight from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.wall_time, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return scalars, acc.FirstEventTimestamp()


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    r = run_script("--out", str(out), "--threshold", "0.0", *OVERRIDES)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out, r.stdout


def test_runs_differ_only_in_mode(compared):
    out, stdout = compared
    cfg = {m: json.loads((out / "runs" / m / "config.json").read_text()) for m in ("async", "sync")}
    assert cfg["async"]["mode"] == "async" and cfg["sync"]["mode"] == "sync"
    cfg["sync"]["mode"] = "async"
    assert cfg["async"] == cfg["sync"]
    assert "tokens/s (total)" in stdout and "speedup async/sync" in stdout


def test_from_logs_report_plots_and_numbers(compared, tmp_path):
    out, _ = compared
    a_dir, s_dir = str(out / "runs" / "async"), str(out / "runs" / "sync")
    events = {"async": read_events(a_dir), "sync": read_events(s_dir)}
    # a threshold some but not necessarily all validation points reach
    all_vals = sorted(v for m in events for _, _, v in events[m][0][VAL_TAG])
    threshold = all_vals[len(all_vals) // 2]
    dest = tmp_path / "report"
    r = run_script("--from-logs", s_dir, a_dir, "--out", str(dest), "--threshold", str(threshold))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = (dest / "report.md").read_text()
    summary = json.loads((out / "runs" / "async" / "summary.json").read_text())
    assert summary["hardware"] and f"Hardware: {summary['hardware']}" in report
    assert "none: both runs used the same resolved config except `mode`" in report
    assert "- async: 2 cpu device(s) (trainer 1, rollout 1)" in report
    assert "- sync: 1 cpu device(s) (trainer 1, rollout 0, colocated)" in report
    for name in PLOTS:
        png = dest / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name}.png)" in report

    table = json.loads((dest / "table.json").read_text())
    assert table["config_diff"] == []
    for mode, devices in (("async", 2), ("sync", 1)):
        scalars, first = events[mode]
        got = table["modes"][mode]
        step_s = [v for _, _, v in scalars["timing_s/step"]]
        tokens = [v for _, _, v in scalars["perf/total_num_tokens"]]
        assert got["steps"] == len(step_s) == 3
        assert got["devices"]["total"] == devices
        assert got["tokens_per_s"] == pytest.approx(sum(tokens) / sum(step_s), rel=1e-9)
        assert got["tokens_per_s_per_device"] == pytest.approx(sum(tokens) / sum(step_s) / devices, rel=1e-9)
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
        for key, tag in (("trainer_idle_ratio", "fully_async/trainer/idle_ratio"),
                         ("rollouter_idle_ratio", "fully_async/rollouter/idle_ratio"),
                         ("staleness_mean", "fully_async/staleness/mean")):
            vs = [v for _, _, v in scalars[tag]]
            assert got[key] == pytest.approx(sum(vs) / len(vs), rel=1e-6), key
    ratio = table["modes"]["async"]["tokens_per_s"] / table["modes"]["sync"]["tokens_per_s"]
    assert table["speedup"]["tokens_per_s"] == pytest.approx(ratio)
    assert f"{table['modes']['async']['tokens_per_s']:.1f}" in r.stdout


def test_config_diff_beyond_mode_is_refused(compared, tmp_path):
    out, _ = compared
    a_dir, s_dir = tmp_path / "async", tmp_path / "sync"
    shutil.copytree(out / "runs" / "async", a_dir)
    shutil.copytree(out / "runs" / "sync", s_dir)
    cfg = json.loads((s_dir / "config.json").read_text())
    cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] = 0.5
    (s_dir / "config.json").write_text(json.dumps(cfg))
    r = run_script("--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "refused"))
    assert r.returncode == 2, r.stdout + r.stderr
    named = [line.split(":")[0].strip() for line in r.stderr.splitlines() if line.startswith("  ")]
    assert named == ["actor_rollout_ref.actor.optim.lr"], r.stderr
    assert not (tmp_path / "refused" / "report.md").exists()
    # a deliberate difference is accepted when named, and the report states it
    r = run_script("--from-logs", str(a_dir), str(s_dir), "--out", str(tmp_path / "allowed"),
                   "--allow-diff", "actor_rollout_ref.actor.optim.lr")
    assert r.returncode == 0, r.stdout + r.stderr
    lr = json.loads((a_dir / "config.json").read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"]
    report = (tmp_path / "allowed" / "report.md").read_text()
    assert f"`actor_rollout_ref.actor.optim.lr`: async `{lr}` vs sync `0.5`" in report
    # two runs of the same mode, or a mode override, are not a sync/async comparison
    assert run_script("--from-logs", str(a_dir), str(a_dir), "--out", str(tmp_path / "x")).returncode == 2
    assert run_script("--out", str(tmp_path / "x"), "mode=sync").returncode == 2


def test_bench_pipeline_measures_both_stages():
    import torch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_pipeline

    threads = torch.get_num_threads()
    res = bench_pipeline.measure([f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
                                  f"actor_rollout_ref.rollout.n={N}", "trainer.device=cpu",
                                  f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * N}"], batches=1)
    assert torch.get_num_threads() == threads   # the 1-thread setting does not leak
    assert res["threads"] == 1 and res["device"] == "cpu"
    for stage in ("rollout", "train"):
        assert res[stage]["tokens_per_s"] > 0 and res[stage]["seconds"] > 0
        assert res[stage]["samples"] == MINI * N
    assert res["rollout"]["tokens"] == res["train"]["tokens"] > MINI * N   # same samples, prompt + response
    assert res["min_tokens_per_s"] == min(res["rollout"]["tokens_per_s"], res["train"]["tokens_per_s"])
    assert "rollout-only" in bench_pipeline.format_table(res)


CORE_METRICS = ["perf/throughput", "perf/time_per_step", "perf/total_num_tokens", "timing_s/gen",
                "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/param_sync",
                "timing_s/step", "fully_async/count/total_generated_samples", "fully_async/count/current_param_version",
                "fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio",
                "fully_async/partial/total_partial_num", "fully_async/partial/partial_ratio",
                "fully_async/partial/max_partial_span", "fully_async/staleness/mean", "actor/pg_loss",
                "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
                "critic/score/mean", "response_length/mean", "response_length/max", "response_length/clip_ratio",
                VAL_TAG]


def test_sync_logs_the_same_metric_set_as_async(compared):
    out, _ = compared
    tags = {m: set(read_events(str(out / "runs" / m))[0]) for m in ("async", "sync")}
    for mode in ("async", "sync"):
        assert not [m for m in CORE_METRICS if m not in tags[mode]], mode
    # colocation is visible in sync mode: per-phase memory and the switch timings
    assert {"memory/generate/host_rss_gib", "memory/update_actor/host_rss_gib", "timing_s/offload",
            "timing_s/onload"} <= tags["sync"]
    sync_versions = read_events(str(out / "runs" / "sync"))[0]["fully_async/staleness/max"]
    assert [v for _, _, v in sync_versions] == [0.0, 0.0, 0.0]   # every sync sample is on-policy
