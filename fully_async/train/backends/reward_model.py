"""The reward model of reward_model.enable (layer 5): frozen, beside the actor in a `TorchBackend` (torch or one FSDP2
rank: the same device, sharding, dtype, offload and Ulysses groups as the reference model), as verl's
RewardModelWorker builds it: Hugging Face's `...ForTokenClassification` with one label over the reward model's
folder (a `...ForSequenceClassification` checkpoint loads into it: the same `score` head), and a response's score is
the model's output at its last token (what the sequence-classification head would pool).  Its inputs are the
reward model's own tokens (rewards/reward_model.py), one row per response.
"""
from __future__ import annotations

from typing import Any

import torch

from fully_async.core.batch import TrainBatch


def last_token_scores(model: torch.nn.Module, batch: TrainBatch, packed: bool) -> torch.Tensor:
    """(B,) float32: the model's (one-label) output at each row's last token (rows right-padded)."""
    from fully_async.train.backends.torch_backend import model_inputs, sequence_split

    inputs, ids, _ = model_inputs(batch, packed)
    inputs, _, gather = sequence_split(model, inputs, ids)
    out = gather(model(**inputs).logits.squeeze(-1).float().reshape(-1))
    lengths = batch.attention_mask.sum(-1)
    if packed:   # the rows' tokens back to back
        ends = lengths.cumsum(0) - 1
    else:
        ends = torch.arange(len(lengths), device=lengths.device) * batch.attention_mask.shape[1] + lengths - 1
    return out[ends.to(out.device)]


class RewardModel:
    def __init__(self, cfg: Any, device: Any, fsdp: bool, compute_dtype: torch.dtype, sp: int = 1):
        from transformers import AutoConfig, AutoModelForTokenClassification

        from fully_async.train.backends import fsdp as fsdp_helpers
        from fully_async.train.backends.torch_backend import model_overrides

        rm, arr = cfg.reward_model, cfg.actor_rollout_ref
        overrides = model_overrides(arr.model, device, sp, rm.model.override_config)
        attn = overrides.pop("attn_implementation")
        config = AutoConfig.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code, **overrides)
        config.num_labels = 1
        config.classifier_dropout = 0.0
        self.model = AutoModelForTokenClassification.from_pretrained(
            rm.model.path, config=config, dtype=torch.float32 if fsdp else compute_dtype, attn_implementation=attn,
            trust_remote_code=rm.model.trust_remote_code).to(device.torch_device())
        self.model.eval().requires_grad_(False)
        if fsdp:
            offload = arr.actor.fsdp_config.offload_policy and device.is_accelerator   # host-resident shards
            mesh = fsdp_helpers.shard_mesh(device.torch_device().type, arr.actor.fsdp_config.fsdp_size)
            fsdp_helpers.shard_model(self.model, compute_dtype, offload, mesh)
        self.settings = rm   # micro-batch keys of its forward passes

    @torch.no_grad()
    def scores(self, batch: TrainBatch, splits: list[tuple[list[int], bool]], device: torch.device,
               packed: bool) -> torch.Tensor:
        """(B,) scores of `batch`, micro-batch by micro-batch (`splits`: row indices and whether the pass is a dummy
        that only keeps collectives in step)."""
        out = torch.zeros(len(batch), dtype=torch.float32)
        for idx, dummy in splits:
            values = last_token_scores(self.model, batch.select(idx).to(device), packed)
            if not dummy:
                out[idx] = values.cpu()
        return out
