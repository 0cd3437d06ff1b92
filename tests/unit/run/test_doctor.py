"""python -m fully_async.doctor: a pass/fail table with fixes, exit code 1 on any failure.  Most checks call the
doctor's main() in this process (a `python -m` start is ~4 s of the 2-core CI machine); two runs go through the real
entry point: the process's exit codes (0 and 1) and a warning on its stderr."""
import subprocess
import sys

import pytest


def doctor_process(*args):
    return subprocess.run([sys.executable, "-m", "fully_async.doctor", "--no-ray", *args], capture_output=True,
                          text=True, timeout=180)


@pytest.fixture
def doctor(capsys, caplog):
    """main(["--no-ray", *args]) in this process: (exit code, stdout, log text)."""
    from fully_async.run.doctor import main

    def call(*args):
        capsys.readouterr()
        caplog.clear()
        code = main(["--no-ray", *args])
        return code, capsys.readouterr().out, caplog.text
    return call


def test_doctor_passes_on_the_default_config(doctor):
    code, out, _ = doctor()
    assert code == 0, out
    for row in ("PASS  torch + device", "PASS  Hydra config", "PASS  requested device", "PASS  data + reward",
                "PASS  model + tokenizer", "PASS  attention kernel    sdpa (padded rows on"):
        assert row in out
    assert "0 FAIL" in out and "every row valid" in out


def test_doctor_reports_failures_with_fixes():
    """Through `python -m`: the process exits 1."""
    r = doctor_process("trainer.device=npu", "data.prompt_key=question")
    assert r.returncode == 1
    assert "FAIL  torch_npu / CANN" in r.stdout and "fix: pip install 'fully_async[npu]'" in r.stdout
    assert "FAIL  data + reward" in r.stdout and "data.prompt_key" in r.stdout
    assert "FAIL  requested device" in r.stdout and "torch_npu" in r.stdout


def test_doctor_runs_the_runs_checks_on_device_rows_and_reward(tmp_path, doctor):
    """What the run would reject, the doctor rejects: an absent device, an empty prompt row, a NaN reward."""
    import json

    import torch

    if not torch.cuda.is_available():
        code, out, _ = doctor("trainer.device=cuda")
        assert code == 1 and "FAIL  requested device" in out and "no CUDA device" in out
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": "2"}} for _ in range(3)]
    rows[2]["prompt"] = [{"role": "user", "content": " "}]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = doctor(f"data.train_files={data}", "data.val_files=null", "actor_rollout_ref.rollout.n=2")
    assert code == 1 and "FAIL  data + reward" in out and "bad.jsonl row 2 (0-based)" in out
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float('nan')\n")
    code, out, _ = doctor(f"custom_reward_function.path={reward}")
    assert code == 1 and "FAIL  data + reward" in out, out


def test_doctor_names_the_packed_attention_kernel_and_refuses_one_without_cpu_backward(doctor):
    code, out, _ = doctor("actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cpu")
    assert code == 0 and "PASS  attention kernel    varlen (packed rows on cpu)" in out, out
    code, out, _ = doctor("+actor_rollout_ref.model.override_config.attn_implementation=flex_attention",
                          "trainer.device=cpu")
    assert code == 1 and "FAIL  attention kernel" in out and "no backward there" in out, out


def test_doctor_shows_the_rollout_placement(doctor):
    code, out, _ = doctor("rollout.n_gpus_per_node=2", "trainer.device=cpu")
    assert code == 0, out
    assert "PASS  placement" in out and "async: 2 rollout replica(s) x 1 device(s) + 1 trainer rank(s)" in out
    _, out, _ = doctor("mode=sync", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2",
                       "trainer.device=cpu")
    assert "sync: 2 trainer rank(s), each generating with its own engine" in out, out


def test_doctor_reads_verl_keys_as_the_run_does(doctor):
    """The same override handling as the entry point: a warned verl key passes with its warning on the process's
    stderr (and exit code 0, through `python -m`), a typo fails."""
    r = doctor_process("actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.actor.optim.lr_decay_style=cosine")
    assert r.returncode == 0 and "PASS  Hydra config" in r.stdout, r.stdout + r.stderr
    assert "actor_rollout_ref.hybrid_engine=False is accepted but has no effect here" in r.stderr
    code, out, _ = doctor("+trainer.typo=3")
    assert code == 1 and "FAIL  Hydra config" in out and "'trainer.typo'" in out
