"""The pipeline simulation reproduces a real CPU comparison: both modes of scripts/compare_sync_async.py on the
tiny task (async 1 rollout + 1 trainer core vs sync on 2 cores), a synthetic lognormal workload with EOS ignored
(so the response lengths are known), then scripts/sim_check.py predicts each run's tokens/s from the stage costs
that run logged (engine ms per decode step, trainer busy time per token, weight-update seconds) and the run's own
config (staleness bound, n, groups per step, slots).  Within 15% in both modes (BOUND).  Timing noise on
a loaded machine moves a run's measured costs and its throughput together, so the check is robust to most of it; a
mode outside its bound is measured once more.

Slow: two measured CPU runs of the comparison (sync on both cores, then async on one rollout and one trainer core)
and a simulation of each; marked `alone` (the runs assume two free cores), so it runs while the other worker waits:
83-100 s in fresh-clone runs."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.alone]   # timing: see suite_budget.machine_share

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
OVERRIDES = ["trainer.total_training_steps=10", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.train_batch_size=8",
             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
             "trainer.progress_bar=false", "trainer.device=cpu", "benchmark.response_length=lognormal",
             "benchmark.ignore_eos=true", "data.max_response_length=64", "trainer.val_before_train=false",
             "data.val_files=null", "trainer.logger=[console,tensorboard]"]


def compare(out) -> tuple:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_sync_async.py"), "--out", str(out),
                        "--threshold", "0.0", "--split", "1", "--repeats", "1", *OVERRIDES], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    base = out / "runs" if (out / "runs").is_dir() else out / "repeat_0" / "runs"
    return base / "async", base / "sync"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare(tmp_path_factory.mktemp("simcmp"))


# the bound per mode.  Sync replays within 1%.  Async's replay sat at +7-10% on 2026-11-26 (docs/planner.md) and
# drifted to +11-16% by 2026-11-30: the engine's own decode step got faster on this CPU (4.5 -> 3.1 ms) while the
# rollouter still waited for the queue actor at every completed group (4.4 ms a push, the engine idle in the same
# thread; not in the logged stage costs), and the engines' load after an object-store push was never simulated.
# With the hand-off not waited for and the load simulated (weight_load_s) it reads -1.9% to +8.3% (docs/planner.md)
BOUND = {"sync": 0.15, "async": 0.15}


def test_simulation_within_15_percent_of_both_modes(runs, tmp_path):
    """A measured mode outside its bound is measured once more (fresh runs of both modes) and must be within it
    then (a run slowed by a transient stall its logged costs do not show); a simulation that is wrong misses both
    times."""
    from fully_async.compare.runs import read_run
    from sim_check import predict

    def misses(pair) -> list:
        out = []
        for log_dir in pair:
            p = predict(read_run(str(log_dir)))
            assert p["predicted"]["steps"] == 10 and p["predicted"]["tokens"] > 0
            if abs(p["error"]) >= BOUND[p["mode"]]:
                out.append((p["mode"], p["predicted"]["tokens_per_s"], p["measured_tokens_per_s"], p["error"]))
        return out

    first = misses(runs)
    if first:
        again = misses(compare(tmp_path / "again"))
        assert not again, (first, again)


def test_the_check_refuses_runs_whose_lengths_were_not_logged(runs, tmp_path):
    import json
    import shutil

    from fully_async.compare.runs import read_run
    from sim_check import predict

    copy = tmp_path / "async"
    shutil.copytree(runs[0], copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["benchmark"]["ignore_eos"] = False
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="ignore_eos"):
        predict(read_run(str(copy)))
