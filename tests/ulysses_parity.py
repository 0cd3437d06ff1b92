"""Ulysses sequence parallelism against one device, shared by the gloo (tests/unit/train/test_ulysses.py) and the CUDA
(tests/gpu/test_ulysses_cuda.py) tests: a trainer group of `world` ranks at ulysses_sequence_parallel_size=2 computes
the same log-probs, values, critic and actor updates and weights as one device."""
import pytest
import torch

from fully_async.actors.train_worker import TrainWorker
from fully_async.cluster.network import free_port
from fully_async.core.batch import build_batch
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends import ulysses
from fully_async.train.group import GroupBackend, build_local_backend, connect_trainer_group
from fully_async.train.ppo_update import critic_update, ppo_update
from fully_async.train.train_step import prepare_batch
import tests_helpers
from tests_helpers import tiny_samples

SP = 2
COMMON = ["actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.rollout.n=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
          "async_training.use_rollout_log_probs=false", "actor_rollout_ref.model.use_remove_padding=true",
          "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
          "data.max_prompt_length=4", "data.max_response_length=4", "algorithm.adv_estimator=gae",
          "critic.optim.lr=0.01", "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.gamma=0.99",
          "algorithm.lam=0.95"]


def check_parity(device, world: int, resources: dict, overrides: list[str], rel: float = 1e-4,
                 atol: float = 1e-5, mean: bool = False) -> None:
    """One device (`device`) against `world` ranks (each with Ray `resources`) at sequence parallel 2.  Tensors agree
    within `atol` everywhere, or on average with `mean` (bf16: a reordered reduction moves single tokens by more).
    Updated weights: all within 10 x atol on CPU; on a GPU 99% of them (AdamW's first steps move a weight whose
    gradient is ~0 by +-lr whichever sign the rounding gave it).  Clip fractions count tokens: with `mean` (bf16) a
    token at the clip boundary may fall either side, so they agree within 0.1 (2 of the ~24 tokens of a mini-batch)."""

    def agree(key, got, ref):
        tol = 0.1 if mean and key.endswith("clipfrac") else atol / 10
        assert got[key] == pytest.approx(ref[key], rel=rel, abs=tol), (key, got[key], ref[key])

    def close(got, ref, tol):
        got, ref = got.float().cpu(), ref.float().cpu()
        return bool((got - ref).abs().mean() <= tol) if mean else torch.allclose(got, ref, atol=tol)

    import torch.distributed as dist

    samples = tiny_samples(groups=4, n=3)   # 12 responses, 2 mini-batches of 6
    single_cfg = load_config(COMMON + overrides)
    # verl's fsdp on one device: plain torch in float32, a one-rank fsdp2 in bf16 (a process group of its own, gone
    # before the group's ranks meet)
    single = build_local_backend(single_cfg, device, 10, 0, 1, None, engine_beside=False)
    batch = build_batch(samples)
    prepare_batch(single, single_cfg, batch, {})
    ref_critic = critic_update(single, single_cfg, batch, num_mini_batches=2)
    ref_actor = ppo_update(single, single_cfg, batch, num_mini_batches=2)
    ref_weights = {name: t.detach().float().cpu() for name, t in single.iter_full_parameters()}
    ref_log_probs = single.compute_log_probs(batch)
    del single
    if dist.is_initialized():
        dist.destroy_process_group()

    cfg = load_config(COMMON + overrides + ["actor_rollout_ref.actor.strategy=fsdp2", f"trainer.n_gpus_per_node={world}",
                                            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={SP}"])
    group = connect_trainer_group(cfg, device, 10, ("127.0.0.1", free_port()), resources, worker=TrainWorker)
    try:
        assert isinstance(group, GroupBackend) and group.world == world and group.data_parallel_size == world // SP
        assert group.local.model.config._attn_implementation == ulysses.NAME
        batch2 = build_batch(samples)
        prepare_batch(group, cfg, batch2, {})
        for name in ("old_log_probs", "ref_log_probs", "values", "advantages"):
            got, ref = getattr(batch2, name).float().cpu(), getattr(batch, name).float().cpu()
            assert close(got, ref, atol), (name, (got - ref).abs().max(), (got - ref).abs().mean())
        got_critic = critic_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            agree(key, got_critic, ref_critic)
        got = ppo_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            agree(key, got, ref_actor)
        full = group.named_parameters_for_sync()
        for name, p in ref_weights.items():
            diff = (full[name].float().cpu() - p).abs()
            far = float((diff > 10 * atol).float().mean())
            assert far <= (0.0 if device.name == "cpu" else 0.01), (name, far, diff.max())
        if device.name == "cpu":   # on a GPU the 1% of weights AdamW moved apart (above) move these too
            assert close(group.compute_log_probs(batch2), ref_log_probs, atol)
    finally:
        tests_helpers.close_group(group)
