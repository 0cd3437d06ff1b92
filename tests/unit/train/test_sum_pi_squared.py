"""actor.calculate_sum_pi_squared: the trainer's sum_v pi_v^2 per position (what the optimal-token-baseline estimators
read) equals the softmax of a plain forward at the rollout temperature, padded, packed and with the fused head, on one
device and over two FSDP2 ranks; the estimators are refused without it, and learn the bundled task with it."""
import pytest
import torch

from fully_async.core.batch import build_batch
from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends.token_stats import sum_pi_squared
from fully_async.train.backends.torch_backend import TorchBackend
from tests_helpers import read_scalars, tiny_samples

OTB = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
       "actor_rollout_ref.rollout.temperature=0.7"]


def expected(model, batch, temperature):
    """sum pi^2 of position t's predictive distribution (the logits of position t - 1), 0 at t = 0, on real tokens."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / temperature
    p = torch.softmax(logits, -1)
    out = torch.nn.functional.pad((p * p).sum(-1)[:, :-1], (1, 0))
    return out * batch.attention_mask


def test_chunks_give_verls_formula():
    logits = 4 * torch.randn(37, 50)
    want = torch.exp(torch.logsumexp(2 * logits / 0.7, -1) - 2 * torch.logsumexp(logits / 0.7, -1))
    torch.testing.assert_close(sum_pi_squared(logits, 0.7, chunk_elems=50 * 8), want)
    hidden, weight = torch.randn(37, 16), torch.randn(50, 16)
    torch.testing.assert_close(sum_pi_squared(hidden, 0.7, chunk_elems=50 * 5, weight=weight),
                               sum_pi_squared(hidden @ weight.t(), 0.7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra", [[], ["actor_rollout_ref.model.use_remove_padding=true"],
                                   ["actor_rollout_ref.model.use_fused_kernels=true"]])
def test_the_backend_computes_it_as_a_plain_forward(random_model_dir, extra):
    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}", *OTB, *extra,
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"])
    backend = TorchBackend(cfg, CPU, total_optimizer_steps=1)
    batch = build_batch(tiny_samples(groups=3, n=2))
    got = backend.compute_sum_pi_squared(batch)
    want = expected(backend.model, batch, 0.7)
    mask = batch.attention_mask.bool()
    mask[:, 0] = False
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert bool(((got[mask] > 0) & (got[mask] <= 1)).all())


def test_two_fsdp2_ranks_compute_it_as_one_device(random_model_dir):
    import tests_helpers

    common = [f"actor_rollout_ref.model.path={random_model_dir}", *OTB,
              "actor_rollout_ref.model.use_remove_padding=true"]
    batch = build_batch(tiny_samples(groups=3, n=2))
    want = TorchBackend(load_config(common), CPU, 10).compute_sum_pi_squared(batch)
    cfg = load_config(common + ["actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"])
    with tests_helpers.cpu_group(cfg) as group:
        torch.testing.assert_close(group.compute_sum_pi_squared(batch), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides,key,words", [
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], "actor_rollout_ref.actor.calculate_sum_pi_squared",
     "set it to true"),
    ([*OTB, "actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda"],
     "actor_rollout_ref.actor.calculate_sum_pi_squared", "megatron"),
])
def test_what_cannot_run_is_refused_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(load_config(["actor_rollout_ref.rollout.n=4", *overrides]))
    assert err.value.key == key and words in str(err.value)


def test_the_switch_without_the_estimator_is_warned_inert(caplog):
    validate(load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]))
    assert "calculate_sum_pi_squared=true has no effect" in caplog.text


@pytest.fixture(scope="module")
def ray_session():
    import tests_helpers

    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_estimators_learn_the_bundled_task(tmp_path, monkeypatch, ray_session, estimator):
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    run(load_config(["mode=sync", f"algorithm.adv_estimator={estimator}",
                     "actor_rollout_ref.actor.calculate_sum_pi_squared=true", "trainer.total_training_steps=20",
                     "trainer.test_freq=20", "trainer.progress_bar=false", "trainer.resume_mode=disable",
                     f"trainer.default_local_dir={tmp_path}/ck"]))
    val = [v for _, v in sorted(read_scalars(str(tmp_path / "tb"))["val-core/arithmetic/reward/mean@1"])]
    assert val[-1] - val[0] >= 0.3, val
