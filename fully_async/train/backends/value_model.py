"""The critic of PPO with algorithm.adv_estimator=gae (layer 5): a value model, its AdamW and its LR schedule.

A `ValueModel` belongs to a `TorchBackend` (torch or one FSDP2 rank): it lives on the same device, is sharded the
same way and computes in the same dtype as the actor, so the trainer's process group, the data-parallel group
(train/group.py), checkpoints and offloading carry it with the actor.  The model is the critic's trunk
(critic.model.path, else the actor's model) with a scalar head: Hugging Face's `...ForTokenClassification` with
one label and no dropout, as verl builds it (the head newly initialised).  The value of response token t is the
head's output at position t - 1, the state before the token was generated (verl: `values[:, -response_length - 1:-1]`).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fully_async.algorithms.lr_schedule import lr_lambda
from fully_async.core.batch import TrainBatch


def critic_optimizer_steps(cfg: Any, actor_optimizer_steps: int) -> int:
    """The critic's optimizer steps over the run (its LR schedule's length), from the actor's: the same steps
    with critic.ppo_epochs passes of critic.ppo_mini_batch_size groups instead of the actor's."""
    actor, critic = cfg.actor_rollout_ref.actor, cfg.critic
    minis_total = actor_optimizer_steps / actor.ppo_epochs        # steps x actor mini-batches per step
    return max(1, math.ceil(minis_total * actor.ppo_mini_batch_size / critic.ppo_mini_batch_size)) * critic.ppo_epochs


def token_values(model: torch.nn.Module, batch: TrainBatch, packed: bool) -> torch.Tensor:
    """(B, L) float32 values: position t holds the head's output at t - 1 (0 at t = 0).  Under sequence parallelism
    this rank computes its slice of the packed row and the values are gathered over its group."""
    from fully_async.train.backends.torch_backend import model_inputs, sequence_split

    inputs, ids, to_rows = model_inputs(batch, packed)
    inputs, _, gather = sequence_split(model, inputs, ids)
    return to_rows(gather(model(**inputs).logits.squeeze(-1).float()))


class ValueModel:
    """The critic's model, optimizer and LR schedule, with the settings its backend's optimizer step reads."""

    def __init__(self, cfg: Any, device: Any, actor_optimizer_steps: int, fsdp: bool, compute_dtype: torch.dtype,
                 sp: int = 1):
        from transformers import AutoConfig, AutoModelForTokenClassification

        from fully_async.train.backends.torch_backend import compile_decoder_layers, model_overrides
        from fully_async.train.backends import fsdp as fsdp_helpers

        critic, arr = cfg.critic, cfg.actor_rollout_ref
        self.path = critic.model.path or arr.model.path
        overrides = model_overrides(arr.model, device, sp, critic.model.override_config)
        attn = overrides.pop("attn_implementation")
        config = AutoConfig.from_pretrained(self.path, trust_remote_code=critic.model.trust_remote_code, **overrides)
        config.num_labels = 1
        config.classifier_dropout = 0.0   # a deterministic value head, as verl builds it
        self.model = AutoModelForTokenClassification.from_pretrained(
            self.path, config=config, dtype=torch.float32 if fsdp else compute_dtype, attn_implementation=attn,
            trust_remote_code=critic.model.trust_remote_code).to(device.torch_device())
        if critic.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        if fsdp:
            offload = arr.actor.fsdp_config.offload_policy and device.is_accelerator   # host-resident shards
            mesh = fsdp_helpers.shard_mesh(device.torch_device().type, arr.actor.fsdp_config.fsdp_size)
            fsdp_helpers.shard_model(self.model, compute_dtype, offload, mesh)
        if arr.actor.use_torch_compile:
            compile_decoder_layers(self.model, device)
        optim = critic.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        steps = critic_optimizer_steps(cfg, actor_optimizer_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, steps))
        self.grad_clip = critic.grad_clip
        self.settings = critic     # micro-batch sizes of the forward passes (forward_*) and of the update (ppo_*)

    @torch.no_grad()
    def values(self, batch: TrainBatch, splits: list[tuple[list[int], bool]], device: torch.device,
               packed: bool) -> torch.Tensor:
        """(B, L) values of `batch` (0 off the response), computed micro-batch by micro-batch (`splits`: row
        indices and whether the pass is a dummy that only keeps collectives in step)."""
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for idx, dummy in splits:
            mb = batch.select(idx).to(device)
            values = token_values(self.model, mb, packed)
            if not dummy:
                out[idx, :values.shape[1]] = values.cpu()
        self.model.train(was_training)
        return out * batch.response_mask.float()   # only response tokens have values (verl's compute_values)

    def state(self) -> dict:
        """Optimizer-free extra state (the optimizer is saved with the weights' format)."""
        return {"scheduler": self.scheduler.state_dict()}


def critic_splits_settings(critic: Any) -> tuple[Optional[int], bool, int]:
    """(micro-batch rows, dynamic, token budget) of the critic's forward passes (critic.forward_*)."""
    return critic.forward_micro_batch_size_per_gpu, critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu
