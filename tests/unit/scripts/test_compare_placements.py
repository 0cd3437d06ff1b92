"""scripts/compare_sync_async.py with --placements: which runs it would start with which overrides (built without
running them), refusals before anything runs, and the several-placements summary."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from fully_async.compare import __main__ as cs  # noqa: E402
from fully_async.compare.runs import Run, placement_of  # noqa: E402
from fully_async.compare.placements import format_placements, placements_summary  # noqa: E402
from fully_async.compare.stats import VERSION_TAG, run_ceiling, step_phases, steps_by_version  # noqa: E402


def test_default_placements_and_refusals():
    assert cs.parse_placements(None, 4) == ["split"]
    assert cs.parse_placements(None, 1) == ["colocated"]
    assert cs.parse_placements("split, colocated,elastic,split", 2) == ["split", "colocated", "elastic"]
    with pytest.raises(ValueError, match="--placements 'split,ring'"):
        cs.parse_placements("split,ring", 4)
    with pytest.raises(ValueError, match="one device has only sync and colocated"):
        cs.parse_placements("colocated,elastic", 1)


def test_one_device_runs_sync_and_colocated_with_their_keys():
    devices, overrides = cs.plan_devices(["trainer.device=cuda", "a=1"], 1)
    assert devices == 1
    runs = cs.plan_runs(devices, cs.parse_placements(None, devices), None, overrides)
    assert [(name, mode, p) for name, mode, p, _ in runs] == [("sync", "sync", "split"),
                                                              ("async_colocated", "async", "colocated")]
    assert runs[0][3] == ["trainer.device=cuda", "a=1", "trainer.n_gpus_per_node=1"]
    assert runs[1][3] == ["trainer.device=cuda", "a=1", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=0",
                          "async_training.placement=colocated"]
    cmd, tb = cs.run_command("async", runs[1][3], "/out", runs[1][0])
    assert cmd[1:4] == ["-m", "fully_async.main", "mode=async"] and "trainer.resume_mode=disable" in cmd
    assert cmd[-1] == "hydra.run.dir=/out/hydra/async_colocated" and tb == "/out/runs/async_colocated"


def test_every_placement_at_four_devices_shares_the_split_and_the_sync_run():
    runs = {name: o for name, _, _, o in cs.plan_runs(4, ["split", "colocated", "elastic"], 1, [])}
    assert runs["sync"] == ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.strategy=fsdp2"]
    assert runs["async"] == ["trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=1",
                             "actor_rollout_ref.actor.strategy=fsdp2"]          # split: as before, no placement key
    assert runs["async_elastic"] == ["trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=1",
                                     "async_training.placement=elastic", "actor_rollout_ref.actor.strategy=fsdp2"]
    assert runs["async_colocated"] == ["trainer.n_gpus_per_node=4", "rollout.n_gpus_per_node=0",
                                       "async_training.placement=colocated", "actor_rollout_ref.actor.strategy=fsdp2"]


def test_a_placement_override_goes_to_that_placements_run_only_and_last():
    extra = cs.parse_placement_overrides(["colocated:actor_rollout_ref.rollout.weight_sync=device_ipc",
                                          "colocated:actor_rollout_ref.rollout.pause_mode=keep"], ["split", "colocated"])
    runs = {name: o for name, _, _, o in cs.plan_runs(2, ["split", "colocated"], 1, ["a.b=1"], extra)}
    assert runs["async_colocated"][-2:] == ["actor_rollout_ref.rollout.weight_sync=device_ipc",
                                            "actor_rollout_ref.rollout.pause_mode=keep"]
    assert not any("weight_sync" in o for o in runs["async"] + runs["sync"])


@pytest.mark.parametrize("argv,words", [
    (["--devices", "2", "--placements", "split", "--placement-override", "colocated:a.b=1"], "--placement-override"),
    (["--devices", "2", "--placement-override", "split:trainer.n_gpus_per_node=1"], "set per run by this script"),
    (["--devices", "2", "--placement-override", "split:novalue"], "P:KEY=VALUE"),
    (["--devices", "1", "--placements", "split"], "split and elastic need a rollout and a trainer"),
    (["--devices", "2", "--placements", "colocated", "--split", "1"], "only split and elastic"),
    (["--devices", "2", "async_training.placement=elastic"], "pass --placements instead"),
    (["--devices", "0"], "--devices 0"),
])
def test_bad_flags_are_refused_before_anything_runs(argv, words, tmp_path, capsys):
    assert cs.main([*argv, "--out", str(tmp_path)]) == cs.REFUSED
    assert words in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "bench.json").exists()


def run(mode, placement, trainer, rollout, step, gen, switch, tokens=1000.0):
    scalars = {"timing_s/step": [(1, 1.0, step), (2, 2.0, step)], "timing_s/gen": [(1, 1.0, gen), (2, 2.0, gen)],
               "timing_s/param_sync": [(1, 1.0, switch), (2, 2.0, switch)],
               "perf/total_num_tokens": [(1, 1.0, tokens), (2, 2.0, tokens)]}
    config = {"mode": mode, "async_training": {"placement": placement},
              "trainer": {"nnodes": 1, "n_gpus_per_node": trainer}, "rollout": {"nnodes": 1, "n_gpus_per_node": rollout}}
    return Run("/x", scalars, 0.0, config, {"devices": {"trainer": trainer, "rollout": rollout,
                                                        "total": trainer + rollout, "device": "cuda"}})


def test_step_phases_ceiling_and_placement_of_a_colocated_run():
    col = run("async", "colocated", 1, 0, step=2.0, gen=1.2, switch=0.3)
    assert placement_of(col.config) == "colocated" and placement_of({"mode": "sync"}) == "sync"
    assert step_phases(col, [2.0, 2.0]) == pytest.approx({"generate_s_per_step": 1.2, "train_s_per_step": 0.5,
                                                          "switch_s_per_step": 0.3, "update_s_per_step": None,
                                                          "mfu_actor": None})
    col.scalars.update({"timing_s/update_actor": [(1, 1.0, 0.4), (2, 2.0, 0.2), (3, 3.0, 9.0)],
                        "perf/mfu/actor": [(1, 1.0, 0.5), (2, 2.0, 0.3), (3, 3.0, 0.0)]})
    phases = step_phases(col, [2.0, 2.0])                  # over the steps timed, the update inside the train phase
    assert (phases["update_s_per_step"], phases["mfu_actor"]) == pytest.approx((0.3, 0.4))
    bench = {"rollout": {"tokens_per_s": 300.0}, "train": {"tokens_per_s": 100.0}}
    assert run_ceiling(col, bench) == pytest.approx(1 / (1 / 300 + 1 / 100))     # as sync on its one device


def test_the_first_step_of_each_weight_version_is_timed_apart_from_the_others():
    col = run("async", "colocated", 1, 0, step=2.0, gen=1.2, switch=0.3)
    seconds = [9.0, 5.0, 6.0, 8.0, 5.5, 6.5, 7.0]      # steps 1-7; weight updates after steps 2 and 5
    col.scalars["timing_s/step"] = [(i + 1, float(i), t) for i, t in enumerate(seconds)]
    col.scalars[VERSION_TAG] = [(i + 1, float(i), v) for i, v in enumerate([0, 0, 1, 1, 1, 2, 2])]
    timed = col.after(1)                                 # steps 2-7; step 2's version is compared with step 1's
    assert steps_by_version(col, timed) == pytest.approx({"step_after_update_s": (6.0 + 6.5) / 2,
                                                          "step_inside_version_s": (5.0 + 8.0 + 5.5 + 7.0) / 4,
                                                          # version 1 (steps 3-5) only: 2 has no next version
                                                          "step_whole_versions_s": (6.0 + 8.0 + 5.5) / 3,
                                                          "whole_versions": 1})
    # a version cut by the window's start (steps 4-5 of 3-5) is not whole; 2 is, once version 3 begins at step 8
    col.scalars["timing_s/step"].append((8, 7.0, 4.0))
    col.scalars[VERSION_TAG].append((8, 7.0, 3))
    got = steps_by_version(col, col.after(3))
    assert (got["step_whole_versions_s"], got["whole_versions"]) == pytest.approx(((6.5 + 7.0) / 2, 1))
    del col.scalars["timing_s/step"][-1], col.scalars[VERSION_TAG][-1]
    # an update every step (sync's version moves each step), or none in the steps timed: no split
    col.scalars[VERSION_TAG] = [(i + 1, float(i), v) for i, v in enumerate(range(7))]
    assert steps_by_version(col, timed) == {"step_after_update_s": None, "step_inside_version_s": None,
                                            "step_whole_versions_s": None, "whole_versions": None}
    col.scalars[VERSION_TAG] = [(i + 1, float(i), 0.0) for i in range(7)]
    assert steps_by_version(col, timed)["step_after_update_s"] is None
    del col.scalars[VERSION_TAG]                        # a sync run logs no version
    assert steps_by_version(col, timed)["step_inside_version_s"] is None


def test_placements_summary_ranks_every_run_against_the_shared_sync():
    def table(tps_async, placement, devices):
        return {"modes": {"sync": {"tokens_per_s": 100.0, "time_per_step_s": 10.0, "generate_s_per_step": 8.0,
                                   "train_s_per_step": 1.5, "switch_s_per_step": 0.5,
                                   "devices": {"trainer": 2, "rollout": 0, "device": "cuda"}},
                          "async": {"tokens_per_s": tps_async, "time_per_step_s": 1000.0 / tps_async,
                                    "devices": devices}},
                "speedup": {"tokens_per_s": tps_async / 100.0}}
    summary = placements_summary({"split": table(90.0, "split", {"trainer": 1, "rollout": 1, "device": "cuda"}),
                                  "colocated": table(180.0, "colocated", {"trainer": 2, "rollout": 0,
                                                                          "device": "cuda"})})
    assert [r["placement"] for r in summary["rows"]] == ["sync", "split", "colocated"]
    assert summary["best"] == "colocated" and summary["best_over_sync"] == pytest.approx(1.8)
    text = format_placements(summary)
    assert "fastest: colocated (1.80x sync's tokens/s)" in text
    assert "2+0 (cuda)" in text and "8.000" in text


def test_the_summary_puts_the_planners_simulation_next_to_each_measured_run():
    """2x H200 seed-003 runs (tests/fixtures/gpu_runs/h200_2dev_seed003): each row's every-step tokens/s beside the
    simulation of that run from its own logs; a run the simulator cannot read (no synthetic lengths) gets none."""
    from fully_async.compare.stats import build_table
    from fully_async.compare.runs import read_run

    fix = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures", "gpu_runs", "h200_2dev_seed003")
    sync = read_run(os.path.join(fix, "sync"))
    tables = {}
    for p in ("split", "elastic", "colocated"):
        tables[p] = build_table({"async": read_run(os.path.join(fix, p)), "sync": sync}, 0.0, warmup_steps=1)
        tables[p]["speedup"] = {"tokens_per_s": tables[p]["modes"]["async"]["tokens_per_s"]
                                / tables[p]["modes"]["sync"]["tokens_per_s"]}
    summary = placements_summary(tables)
    assert [r["placement"] for r in summary["rows"]] == ["sync", "split", "elastic", "colocated"]
    for row in summary["rows"]:
        assert abs(row["simulation_error"]) < 0.15, row
        assert row["simulated_tokens_per_s"] == pytest.approx(row["tokens_per_s_all_steps"], rel=0.15)
    assert "simulated" in format_placements(summary) and "-11.5%" in format_placements(summary)
    no_sim = placements_summary(tables, simulate=False)
    assert all(r["simulated_tokens_per_s"] is None for r in no_sim["rows"])


def test_runs_on_different_cards_are_not_compared(tmp_path, capsys):
    """A sync baseline reused from another machine (--sync-log, --from-logs) that ran on other cards: refused,
    naming both (4x H100 split runs against the 4x H200 sync run printed ratios that were no speedups)."""
    import json
    import shutil

    fix = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures", "gpu_runs", "h200_4dev_seed003")
    runs = {}
    for name in ("sync", "colocated"):
        runs[name] = str(tmp_path / name)
        shutil.copytree(os.path.join(fix, name), runs[name])
    path = os.path.join(runs["colocated"], "summary.json")
    summary = json.load(open(path))
    summary["hardware"] = "4x NVIDIA H100 80GB HBM3"
    json.dump(summary, open(path, "w"))
    allowed = ("async_training.placement", "actor_rollout_ref.rollout.weight_sync",
               "actor_rollout_ref.rollout.pause_mode", "rollout.n_gpus_per_node", "trainer.n_gpus_per_node")
    rc, table = cs.compare([runs["colocated"], runs["sync"]], str(tmp_path / "out"), 0.0, None, allowed)
    assert rc == cs.REFUSED and table is None
    err = capsys.readouterr().err
    assert "different hardware" in err and "4x NVIDIA H100 80GB HBM3" in err and "4x NVIDIA H200" in err
    rc, table = cs.compare([runs["colocated"], runs["sync"]], str(tmp_path / "out"), 0.0, None, allowed + ("hardware",))
    assert rc == 0 and table


def test_the_summary_puts_the_planners_forward_prediction_next_to_each_run():
    """4x H200 (tests/fixtures/gpu_runs/h200_4dev_seed003): split 2+2 and colocated each predicted from the sync
    run's costs and their own first-step compiling, against their every-step tokens/s: within 5% (the split's engines
    run ahead while its trainer compiles and the next steps drain that queue; the simulation does the same)."""
    from fully_async.compare.stats import build_table
    from fully_async.compare.runs import read_run

    fix = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures", "gpu_runs", "h200_4dev_seed003")
    sync = read_run(os.path.join(fix, "sync"))
    tables = {}
    for p in ("split", "colocated"):
        tables[p] = build_table({"async": read_run(os.path.join(fix, p)), "sync": sync}, 0.0, warmup_steps=1)
        tables[p]["speedup"] = {"tokens_per_s": tables[p]["modes"]["async"]["tokens_per_s"]
                                / tables[p]["modes"]["sync"]["tokens_per_s"]}
    rows = {r["placement"]: r for r in placements_summary(tables)["rows"]}
    assert all(abs(rows[p]["prediction_error"]) < 0.05 for p in ("sync", "split", "colocated")), rows
    assert rows["colocated"]["predicted_tokens_per_s"] == pytest.approx(118581, rel=0.01)
    assert rows["split"]["predicted_tokens_per_s"] == pytest.approx(114417, rel=0.01)
    text = format_placements(placements_summary(tables))
    assert "predicted" in text and "+2.6%" in text and "-0.3%" in text
