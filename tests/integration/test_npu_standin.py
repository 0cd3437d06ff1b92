"""The Ascend path end to end before it meets an NPU: `trainer.device=npu` runs under the test-only NPU stand-in
(tests/npu_standin: torch.npu over CPU, an `hccl` process-group backend over gloo, Ray finding NPUs through a
stand-in `acl`).  The default async and sync runs learn the bundled task; each actor sees its own NPU through
ASCEND_RT_VISIBLE_DEVICES; the trainer world and the weight broadcast are built on `hccl`; the fused varlen attention
goes through torch_npu.npu_fusion_attention; a run resumes from its checkpoint; the doctor reports an NPU node.
The stand-in poisons torch.cuda and nccl for the package's own code: a call from fully_async fails the run and is
logged, and every test asserts none was made.
Slow: 8 training runs as subprocesses and the doctor's (the stand-in cannot be loaded into the pytest process, so no run
can share its Ray): one async run per tensor kind serves both the learning and the resume test, the resumes, the
sync 20-step learning run, the reward model, the doctor and npu_on_cuda_check's two sync runs."""
import os

import pytest

from npu_standin_helpers import read_log, ray_npu_count, run_main, standin_env
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
VAL = "val-core/arithmetic/reward/mean@1"


@pytest.fixture(scope="module")
def ray_sees_npus(tmp_path_factory) -> None:
    """Skips the module's runs where Ray cannot declare NPUs through the stand-in (asked once: a Ray import)."""
    log = str(tmp_path_factory.mktemp("probe") / "standin.jsonl")
    found = ray_npu_count(standin_env(log, devices=2))
    if found != 2:
        pytest.skip(f"this Ray cannot declare NPU resources through the stand-in's acl (found {found})")


def npu_env(tmp_path, tensors: str = "backend") -> tuple[dict, str]:
    """The environment of a run under the stand-in (2 NPUs on this node) and its log.  Its npu tensors: the CPU
    backend's own, or ("npu") PrivateUse1 tensors over CPU memory, the kind the stand-in makes on CUDA
    (tests/npu_standin/torch_npu/_tensor.py)."""
    log = str(tmp_path / "standin.jsonl")
    return standin_env(log, devices=2, TENSORBOARD_DIR=str(tmp_path / "tb"), FA_NPU_STANDIN_TENSORS=tensors), log


@pytest.fixture
def npu(ray_sees_npus, tmp_path):
    return npu_env(tmp_path)


def common(tmp_path, name: str = "run") -> list[str]:
    return ["trainer.device=npu", "trainer.progress_bar=false", f"trainer.default_local_dir={tmp_path}/ckpt",
            f"hydra.run.dir={tmp_path}/hydra_{name}"]


def check_ok(r) -> None:
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def check_learned(tb: str) -> None:
    val = [v for _, v in sorted(read_scalars(tb)[VAL])]
    assert val[-1] - val[0] >= 0.3 and val[-1] >= 0.8, val


def actor_records(log: list[dict]) -> dict[int, dict]:
    """Per Ray worker process (not the driver): the devices it saw and the collective backends it built."""
    out: dict[int, dict] = {}
    for rec in log:
        proc = out.setdefault(rec["pid"], {"visible": None, "backends": [], "inits": [], "driver": False})
        if rec["event"] == "import":
            proc["visible"] = rec["ASCEND_RT_VISIBLE_DEVICES"]
            proc["driver"] = rec["argv0"] != "default_worker.py"
        elif rec["event"] == "backend":
            proc["backends"].append((rec["name"], rec["rank"], rec["size"]))
        elif rec["event"] == "init_process_group":
            proc["inits"].append(rec["backend"])
    return {pid: p for pid, p in out.items() if not p["driver"]}


def check_no_cuda_or_nccl(log: list[dict]) -> None:
    bad = [r for r in log if r["event"] == "violation"]
    assert not bad, bad
    assert all(r["backend"] == "hccl" for r in log if r["event"] == "init_process_group"), log


@pytest.fixture(scope="module", params=["backend", "npu"])
def async_run(ray_sees_npus, tmp_path_factory, request):
    """ONE default async run per tensor kind, 20 steps (validation reward 0.03 -> 0.93-0.95 in 3 tries each; 0.96
    at the bundled task's 40), saving its final checkpoint (save_freq past the end: only the final one): the
    learning test reads it and the resume test continues from it.  (env, log path, run dir, result)."""
    tmp_path = tmp_path_factory.mktemp(f"async_{request.param}")
    env, log_path = npu_env(tmp_path, request.param)
    r = run_main(env, *common(tmp_path), "trainer.save_freq=1000", "trainer.total_training_steps=20")
    return env, log_path, tmp_path, r


def test_async_run_learns_with_an_npu_per_actor_and_hccl_weight_sync(async_run):
    env, log_path, tmp_path, r = async_run
    check_ok(r)
    check_learned(str(tmp_path / "tb"))
    log = read_log(log_path)
    check_no_cuda_or_nccl(log)
    actors = actor_records(log)
    # the trainer and the rollouter: one NPU each, Ray's NPU ids 0 and 1 (ASCEND_RT_VISIBLE_DEVICES)
    assert sorted(p["visible"] for p in actors.values()) == ["0", "1"], actors
    # the weight broadcast group: trainer rank 0 + the engine, both ProcessGroupHCCL
    groups = sorted(b for p in actors.values() for b in p["backends"])
    assert groups == [("hccl", 0, 2), ("hccl", 1, 2)], groups


def test_sync_run_learns_on_two_npus_over_hccl_with_fused_varlen_attention(npu, tmp_path):
    """20 steps: validation reward 0.03 -> 0.91 (3 tries: 0.906, 0.914, 0.914; 0.97 at 30)."""
    env, log_path = npu
    check_ok(run_main(env, *common(tmp_path), "mode=sync", "trainer.n_gpus_per_node=2",
                      "actor_rollout_ref.model.use_remove_padding=true", "trainer.total_training_steps=20"))
    check_learned(str(tmp_path / "tb"))
    log = read_log(log_path)
    check_no_cuda_or_nccl(log)
    actors = actor_records(log)
    ranks = [p for p in actors.values() if p["inits"]]
    assert sorted(p["visible"] for p in ranks) == ["0", "1"], actors     # one NPU per trainer rank
    assert all(p["inits"] == ["hccl"] for p in ranks), ranks             # FSDP's world on hccl
    fused = {(r["layout"], r["causal"]) for r in log if r["event"] == "npu_fusion_attention"}
    assert ("TND", True) in fused, fused     # packed rows: transformers' flash_attention_2 -> npu_fusion_attention


def test_a_reward_models_scores_are_the_rewards_on_two_npus(npu, tmp_path):
    """reward_model.enable on an accelerator (offloaded and onloaded with the trainer, sharded over hccl, packed rows
    through the fused attention): a token classifier whose every output is 0.375 gives every reward and validation
    score."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "unit" / "train"))
    from test_reward_model import make_reward_model

    env, log_path = npu
    rm = make_reward_model(tmp_path / "rm", kind="token", bias=0.375)
    check_ok(run_main(env, *common(tmp_path), "mode=sync", "trainer.n_gpus_per_node=2",
                      "actor_rollout_ref.model.use_remove_padding=true", "trainer.total_training_steps=3",
                      "reward_model.enable=true", f"reward_model.model.path={rm}", "trainer.test_freq=3"))
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [round(v, 4) for _, v in scalars["critic/score/mean"]] == [0.375] * 3
    assert [round(v, 4) for _, v in scalars[VAL]] == [0.375, 0.375]
    check_no_cuda_or_nccl(read_log(log_path))


def test_async_run_resumes_from_its_checkpoint_on_npu(async_run):
    """The learning run's final checkpoint (global_step_<last>) resumed for 2 more steps, per tensor kind."""
    env, log_path, tmp_path, first = async_run
    check_ok(first)
    last = max(s for s, _ in read_scalars(str(tmp_path / "tb"))["actor/pg_loss"])
    assert os.path.isdir(tmp_path / "ckpt" / f"global_step_{last}"), os.listdir(tmp_path / "ckpt")
    log2 = str(tmp_path / "standin_resumed.jsonl")   # its own log: the learning test reads the first run's
    env2 = dict(env, TENSORBOARD_DIR=str(tmp_path / "tb2"), FA_NPU_STANDIN_LOG=log2)
    r = run_main(env2, *common(tmp_path), "trainer.test_freq=-1", "trainer.val_before_train=false",
                 f"trainer.total_training_steps={last + 2}", "trainer.resume_mode=auto",
                 "hydra.run.dir=" + str(tmp_path / "h2"))
    check_ok(r)
    assert "resuming from" in r.stdout + r.stderr and f"global_step_{last}" in r.stdout + r.stderr
    steps = [s for s, _ in read_scalars(str(tmp_path / "tb2"))["actor/pg_loss"]]
    assert steps == [last + 1, last + 2], steps   # the resumed run trains only the remaining steps
    check_no_cuda_or_nccl(read_log(log_path) + read_log(log2))
    assert read_log(log2), "the resumed run ran outside the stand-in"


def test_doctor_reports_an_npu_node(npu, tmp_path):
    env, log_path = npu
    env = dict(env, ASCEND_TOOLKIT_HOME="/usr/local/Ascend/ascend-toolkit/latest")   # what CANN's set_env.sh sets
    r = run_main(env, "trainer.device=npu", module="fully_async.doctor", timeout=240)
    out = r.stdout
    assert r.returncode == 0 and "0 FAIL" in out, out + r.stderr[-2000:]
    lines = {line.split()[1]: line for line in out.splitlines() if line[:4] in ("PASS", "WARN", "FAIL", "SKIP")}
    assert "trainer.device=auto -> npu" in lines["torch"], out
    assert lines["CUDA"].startswith("SKIP"), out
    assert ("torch_npu 2.10.0.post4+standin, CANN at /usr/local/Ascend/ascend-toolkit/latest, 2 NPU(s), "
            "ASCEND_RT_VISIBLE_DEVICES=all") in lines["torch_npu"], out
    assert "'NPU': 2.0" in lines["Ray"], out
    assert "= 2 npu device(s); this host sees 2" in lines["placement"], out
    check_no_cuda_or_nccl(read_log(log_path))


def test_with_privateuse1_npu_tensors_a_sync_run_trains_as_the_cpu_run(npu, tmp_path):
    """The stand-in's CUDA kind of npu tensor (PrivateUse1 tensors over backend memory: tests/npu_standin/torch_npu/
    _tensor.py), here over CPU: scripts/npu_on_cuda_check.py's sync runs, trainer.device=npu against cpu, packed
    with the fused varlen attention, give the same pg_loss, entropy and grad norm within float32 rounding (the npu
    run's attention takes sdpa's math path) -- what its CUDA run compares on a GPU."""
    import json
    import subprocess
    import sys

    from npu_standin_helpers import REPO

    out = tmp_path / "npu_vs_cpu.json"
    r = subprocess.run([sys.executable, "scripts/npu_on_cuda_check.py", "--backend", "cpu", "--tensors", "npu",
                        "--steps", "3", "--out", str(out), "actor_rollout_ref.model.use_remove_padding=true"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert r.returncode == 0 and result["ok"], (result.get("diffs"), result["npu"].get("tail"), r.stderr[-2000:])
    assert result["tensors"] == "npu" and result["standin"]["fused_attention"] == [["TND", True]]
    assert all(d["steps"] == 3 for d in result["diffs"].values())
