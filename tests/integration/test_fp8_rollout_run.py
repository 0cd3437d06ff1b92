"""verl's fp8 rollout (actor_rollout_ref.rollout.quantization=fp8) end to end on CPU with the bundled task: the
embedded engine samples with the fp8 arithmetic at every weight version, the trainer sees the larger
rollout/trainer mismatch, and with rollout correction (verl's fp8 recipe: token-level IS, threshold 2) it learns."""
import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import first_and_last_val, read_scalars

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def mean_mismatch(tb_dir):
    values = [v for _, v in read_scalars(tb_dir)["training/rollout_probs_diff_mean"]]
    return sum(values) / len(values)


def test_fp8_rollout_learns_with_a_larger_mismatch_than_the_compute_dtype(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run

    common = ["mode=sync", "trainer.progress_bar=false", "trainer.resume_mode=disable", "trainer.save_freq=-1",
              "actor_rollout_ref.rollout.dtype=float32",          # the plain run's mismatch is then ~0
              "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
    mismatch = {}
    for quantization in ("fp8", "null"):
        tb = tmp_path / f"tb_{quantization}"
        monkeypatch.setenv("TENSORBOARD_DIR", str(tb))
        steps = 30 if quantization == "fp8" else 3
        run(load_config(common + [f"actor_rollout_ref.rollout.quantization={quantization}",
                                  f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={tmp_path}/ck"
                                  f"_{quantization}"]))
        mismatch[quantization] = mean_mismatch(str(tb))
        if quantization == "fp8":
            first, last = first_and_last_val(str(tb))
            assert last - first >= 0.5, (first, last)
    assert mismatch["fp8"] > 10 * mismatch["null"], mismatch
