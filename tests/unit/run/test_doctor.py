"""python -m fully_async.doctor: a pass/fail table with fixes, exit code 1 on any failure."""
import subprocess
import sys


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "fully_async.doctor", "--no-ray", *args], capture_output=True,
                          text=True, timeout=180)


def test_doctor_passes_on_the_default_config():
    r = doctor()
    assert r.returncode == 0, r.stdout + r.stderr
    for row in ("PASS  torch + device", "PASS  Hydra config", "PASS  requested device", "PASS  data + reward",
                "PASS  model + tokenizer", "PASS  attention kernel    sdpa (padded rows on"):
        assert row in r.stdout
    assert "0 FAIL" in r.stdout and "every row valid" in r.stdout


def test_doctor_reports_failures_with_fixes():
    r = doctor("trainer.device=npu", "data.prompt_key=question")
    assert r.returncode == 1
    assert "FAIL  torch_npu / CANN" in r.stdout and "fix: pip install 'fully_async[npu]'" in r.stdout
    assert "FAIL  data + reward" in r.stdout and "data.prompt_key" in r.stdout
    assert "FAIL  requested device" in r.stdout and "torch_npu" in r.stdout


def test_doctor_runs_the_runs_checks_on_device_rows_and_reward(tmp_path):
    """What the run would reject, the doctor rejects: an absent device, an empty prompt row, a NaN reward."""
    import json

    import torch

    if not torch.cuda.is_available():
        r = doctor("trainer.device=cuda")
        assert r.returncode == 1 and "FAIL  requested device" in r.stdout and "no CUDA device" in r.stdout
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": "2"}} for _ in range(3)]
    rows[2]["prompt"] = [{"role": "user", "content": " "}]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = doctor(f"data.train_files={data}", "data.val_files=null", "actor_rollout_ref.rollout.n=2")
    assert r.returncode == 1 and "FAIL  data + reward" in r.stdout and "bad.jsonl row 2 (0-based)" in r.stdout
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float('nan')\n")
    r = doctor(f"custom_reward_function.path={reward}")
    assert r.returncode == 1 and "FAIL  data + reward" in r.stdout, r.stdout


def test_doctor_names_the_packed_attention_kernel_and_refuses_one_without_cpu_backward():
    r = doctor("actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cpu")
    assert r.returncode == 0 and "PASS  attention kernel    varlen (packed rows on cpu)" in r.stdout, r.stdout
    r = doctor("+actor_rollout_ref.model.override_config.attn_implementation=flex_attention", "trainer.device=cpu")
    assert r.returncode == 1 and "FAIL  attention kernel" in r.stdout and "no backward there" in r.stdout, r.stdout


def test_doctor_shows_the_rollout_placement():
    r = doctor("rollout.n_gpus_per_node=2", "trainer.device=cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS  placement" in r.stdout and "async: 2 rollout replica(s) x 1 device(s) + 1 trainer rank(s)" in r.stdout
    r = doctor("mode=sync", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2", "trainer.device=cpu")
    assert "sync: 2 trainer rank(s), each generating with its own engine" in r.stdout, r.stdout


def test_doctor_reads_verl_keys_as_the_run_does():
    """The same override handling as the entry point: a warned verl key passes with its warning, a typo fails."""
    r = doctor("actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.actor.optim.lr_decay_style=cosine")
    assert r.returncode == 0 and "PASS  Hydra config" in r.stdout, r.stdout + r.stderr
    assert "actor_rollout_ref.hybrid_engine=False is accepted but has no effect here" in r.stderr
    r = doctor("+trainer.typo=3")
    assert r.returncode == 1 and "FAIL  Hydra config" in r.stdout and "'trainer.typo'" in r.stdout
