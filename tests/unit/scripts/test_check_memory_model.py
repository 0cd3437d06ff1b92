"""scripts/check_memory_model.py: the estimate side on CPU (the measurement needs a GPU/NPU and refuses cpu)."""
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_memory_model as cmm  # noqa: E402


def cfg(*over):
    from fully_async.run.hydra_setup import load_config

    return load_config(list(over) + cmm.FORCED)


def test_estimates_read_the_local_model_and_force_full_length_responses():
    c = cfg("actor_rollout_ref.rollout.max_num_seqs=64")
    assert c.benchmark.ignore_eos and c.benchmark.response_length == "none"
    est = cmm.estimates(c, 80.0)
    assert est["params"] > 0
    assert est["engine"]["note"].startswith("embedded engine: slot KV cache of 64 x")
    assert set(est["trainer"]["parts_gib"]) >= {"params", "grads", "optimizer", "activations", "logits"}


def test_measuring_on_cpu_is_refused():
    with pytest.raises(SystemExit, match="trainer.device=cuda or npu"):
        cmm.measure(cfg("trainer.device=cpu"))
