"""The actor's LR schedule (algorithms/lr_schedule.py): today's warm-up kept exactly, verl's cosine, config checks,
and both backends reading it."""
import math
from types import SimpleNamespace

import pytest
import torch

from fully_async.algorithms.lr_schedule import lr_lambda, lr_multiplier, warmup_steps
from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config


def optim(**kw):
    base = dict(lr=0.01, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0, lr_scheduler_type="constant",
                min_lr_ratio=0.0, num_cycles=0.5)
    return SimpleNamespace(**{**base, **kw})


def former_lambda(warmup):
    """The warm-up both backends wrote before the shared schedule (LambdaLR lambda / MegatronBackend._lr)."""
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def verl_cosine(current_step, num_warmup_steps, num_training_steps, min_lr_ratio=0.0, num_cycles=0.5):
    """verl.utils.torch_functional.get_cosine_schedule_with_warmup's lambda."""
    coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, math.cos(math.pi * float(num_cycles) * 2.0 * progress) * coef + intercept)


@pytest.mark.parametrize("warmup", [0, 1, 2, 3, 7, 10])
def test_constant_with_warmup_is_the_former_schedule_exactly(warmup):
    fn, old = lr_lambda(optim(lr_warmup_steps=warmup), 10), former_lambda(warmup)
    assert [fn(s) for s in range(25)] == [old(s) for s in range(25)]


@pytest.mark.parametrize("ratio,total,expected", [(0.0, 10, 0), (0.3, 10, 3), (0.25, 10, 2), (1.0, 7, 7)])
def test_warmup_from_ratio(ratio, total, expected):
    o = optim(lr_warmup_steps=-1, lr_warmup_steps_ratio=ratio)
    assert warmup_steps(o, total) == expected
    assert [lr_lambda(o, total)(s) for s in range(12)] == [former_lambda(expected)(s) for s in range(12)]
    assert warmup_steps(optim(lr_warmup_steps=4, lr_warmup_steps_ratio=ratio), total) == 4


def test_torch_lambdalr_gives_the_former_lrs():
    """What TorchBackend builds: the lr of every optimizer step and get_last_lr() after it, as before."""
    def lrs(fn):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
        out = []
        for _ in range(8):
            out.append((opt.param_groups[0]["lr"], sched.get_last_lr()[0]))
            opt.step()
            sched.step()
        return out, sched.state_dict()

    new, new_state = lrs(lr_lambda(optim(lr_warmup_steps=4), 8))
    old, old_state = lrs(former_lambda(4))
    assert new == old and new_state == old_state      # the checkpointed scheduler state is unchanged too


@pytest.mark.parametrize("warmup,total,min_ratio,cycles", [(0, 10, 0.0, 0.5), (3, 12, 0.1, 0.5), (2, 9, 0.25, 1.0),
                                                           (5, 5, 0.0, 0.5)])
def test_cosine_is_verls_one_step_ahead(warmup, total, min_ratio, cycles):
    fn = lr_lambda(optim(lr_warmup_steps=warmup, lr_scheduler_type="cosine", min_lr_ratio=min_ratio,
                         num_cycles=cycles), total)
    assert [fn(s) for s in range(total + 3)] == [verl_cosine(s + 1, warmup, total, min_ratio, cycles)
                                                 for s in range(total + 3)]
    # the warm-up is the constant schedule's
    assert [fn(s) for s in range(warmup)] == [former_lambda(warmup)(s) for s in range(warmup)]


def test_cosine_endpoints_and_min_lr_ratio():
    warmup, total = 3, 13
    fn = lr_lambda(optim(lr_warmup_steps=warmup, lr_scheduler_type="cosine", min_lr_ratio=0.1), total)
    assert [fn(s) for s in range(warmup)] == [1 / 3, 2 / 3, 1.0]      # the last warm-up step reaches lr
    assert fn(warmup + 4) == pytest.approx(0.55)                       # halfway: (1 + min) / 2
    assert fn(total - 1) == pytest.approx(0.1)                         # the last optimizer step: min_lr_ratio
    values = [fn(s) for s in range(warmup - 1, total)]
    assert all(a > b for a, b in zip(values, values[1:]))              # strictly decreasing after the warm-up
    zero = lr_lambda(optim(lr_warmup_steps=0, lr_scheduler_type="cosine"), 10)
    assert zero(9) == 0.0 and zero(0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))
    full_wave = lr_lambda(optim(lr_warmup_steps=0, lr_scheduler_type="cosine", num_cycles=1.0), 10)
    assert full_wave(4) == pytest.approx(0.0, abs=1e-12) and full_wave(9) == pytest.approx(1.0)


def test_unknown_type_is_rejected():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_lambda(optim(lr_scheduler_type="linear"), 10)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_multiplier(5, 0, 10, "linear")


def test_config_defaults_are_verls():
    o = load_config([]).actor_rollout_ref.actor.optim
    assert (o.lr_scheduler_type, o.min_lr_ratio, o.num_cycles) == ("constant", 0.0, 0.5)
    validate(load_config(["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                          "actor_rollout_ref.actor.optim.min_lr_ratio=1.0",
                          "actor_rollout_ref.actor.optim.num_cycles=2"]))


@pytest.mark.parametrize("override,message", [
    ("lr_scheduler_type=linear", "not one of ['constant', 'cosine']"),
    ("lr_scheduler_type=Cosine", "not one of ['constant', 'cosine']"),
    ("min_lr_ratio=1.5", "must be in [0, 1]"),
    ("min_lr_ratio=-0.1", "must be in [0, 1]"),
    ("num_cycles=0", "must be > 0"),
])
def test_bad_schedule_values_name_the_key(override, message):
    key = "actor_rollout_ref.actor.optim." + override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        validate(load_config([f"actor_rollout_ref.actor.optim.{override}"]))
    assert err.value.key == key and key in str(err.value) and message in str(err.value)


def test_megatron_lr_is_the_shared_schedule():
    """MegatronBackend._lr (set as group['lr'] before each optimizer step and reported as actor/lr)."""
    from fully_async.train.backends.megatron_backend import MegatronBackend

    for o, total in ((optim(lr_warmup_steps=3), 10),
                     (optim(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.2), 10)):
        backend = object.__new__(MegatronBackend)
        backend.actor_cfg = SimpleNamespace(optim=o)
        backend.lr_multiplier = lr_lambda(o, total)
        assert [backend._lr(s) for s in range(12)] == [0.01 * lr_lambda(o, total)(s) for s in range(12)]
        if o.lr_scheduler_type == "constant":   # the former MegatronBackend._lr
            assert [backend._lr(s) for s in range(12)] == [0.01 * former_lambda(3)(s) for s in range(12)]


def test_torch_backend_follows_the_cosine_schedule(random_model_dir):
    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.core.batch import build_batch
    from fully_async.device import CPU
    from fully_async.train.ppo_update import ppo_update
    from fully_async.train.train_step import prepare_batch
    from tests_helpers import tiny_samples

    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}", "actor_rollout_ref.actor.optim.lr=0.01",
                       "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
                       "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                       "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"])
    backend = TorchBackend(cfg, CPU, total_optimizer_steps=4)
    batch = build_batch(tiny_samples(groups=2, n=3))
    prepare_batch(backend, cfg, batch, {})
    metrics = ppo_update(backend, cfg, batch, num_mini_batches=2)    # optimizer steps 0 and 1 taken
    assert metrics["actor/lr"] == 0.01 * verl_cosine(3, 1, 4, 0.1)   # the lr of step 2 (k = 3)
