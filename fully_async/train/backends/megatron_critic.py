"""Models with a one-output head on strategy=megatron (layer 5): the critic of PPO (algorithm.adv_estimator=gae), a
value model with the actor's tensor/pipeline/data-parallel layout, its own distributed optimizer and LR schedule;
and the frozen reward model of reward_model.enable (`MegatronRewardModel`).

The model is the critic's trunk (critic.model.path, else the actor's model) as a megatron GPTModel whose output
layer is a one-output value head, as verl's megatron critic replaces it (`LinearForLastLayer`): a plain linear layer
replicated over the tensor-parallel ranks (under sequence parallelism each rank computes its slice of the sequence
and the values are gathered; its gradients are then all-reduced over the tensor ranks with the norms').  The head
starts as Hugging Face's `...ForTokenClassification` head does (normal(0, initializer_range) weight, zero bias),
or from the trunk folder's own `score.*` (a critic checkpoint, a reward model).  The value of response token t is
the head's output at position t - 1, as the torch critic (value_model.py).  Checkpoints: `critic/` as a Hugging
Face ForTokenClassification folder (rank 0) and per-rank optimizer files `critic_megatron_optim/`.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fully_async.algorithms.gae import VALUE_METRICS
from fully_async.algorithms.lr_schedule import lr_lambda
from fully_async.core.batch import TrainBatch
from fully_async.train.backends import MiniBatch, StepResult, hf_megatron
from fully_async.train.backends.value_model import critic_optimizer_steps


class ValueHead(torch.nn.Module):
    """GPTModel's output layer for a critic: (S, B, H) hidden states -> ((S, B, 1) values, None)."""

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        for p in self.linear.parameters():   # megatron all-reduces these over the tensor ranks (finalize_model_grads)
            setattr(p, "sequence_parallel", sequence_parallel)

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        out = self.linear(hidden_states)
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            out = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


def trunk_config(hf_config: Any) -> Any:
    """The trunk's HF config with the embedding untied (the critic has a value head, not an LM head)."""
    import copy

    config = copy.deepcopy(hf_config)
    config.tie_word_embeddings = False
    return config


def build_value_model(owner: Any, path: str, trust_remote_code: bool, train: bool,
                      head_key: str = "") -> tuple[Any, Any]:
    """(model, HF config): the folder's trunk as a GPTModel in `owner`'s layout and dtype, the last pipeline stage's
    output layer replaced by the value head (value_head) before the model moves to the device.  `head_key`: the
    config key of a folder that must bring its own head (a reward model); without `score.weight` it is refused."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    hf_megatron.check_supported(hf_config)
    state = hf_megatron.SafetensorsFolder(path)
    if head_key and "score.weight" not in state:
        raise RuntimeError(f"{head_key}={path} has no score head (score.weight): a reward model is a one-label "
                           "...ForSequenceClassification folder")
    tcfg = owner._transformer_config(hf_config)

    def head(model: torch.nn.Module) -> None:
        if hasattr(model, "output_layer"):        # the last pipeline stage
            model.output_layer = value_head(state, hf_config, owner.dtype, tcfg)

    return owner._build_model(state, train=train, hf_config=trunk_config(hf_config), tcfg=tcfg, head=head), hf_config


class MegatronCritic:
    """Built by a MegatronBackend (`owner`) on the same ranks, layout and dtype as its actor."""

    def __init__(self, owner: Any, cfg: Any, actor_optimizer_steps: int):
        critic = cfg.critic
        self.owner, self.settings = owner, critic
        self.model, self.hf_config = build_value_model(owner, critic.model.path or cfg.actor_rollout_ref.model.path,
                                                       critic.model.trust_remote_code, train=True)
        optim = critic.optim
        self.optimizer = owner._build_optimizer(self.model, optim.lr, optim.weight_decay, optim.betas, critic.grad_clip)
        self.lr_multiplier = lr_lambda(optim, critic_optimizer_steps(cfg, actor_optimizer_steps))
        self.optim_steps = 0

    # ------------------------------------------------------------------ values
    def _values_only(self, mb: TrainBatch, out: torch.Tensor) -> tuple:
        values = token_values(out, mb.input_ids.shape[1])
        return values.new_zeros(()), values

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """(B, L) values of `batch` (0 off the response) on every rank, in critic.forward_* micro-batches."""
        c = self.settings
        out = self.owner.forward_rows(self.model, batch, c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz,
                                      c.forward_max_token_len_per_gpu, self._values_only, batch.input_ids.shape)
        return out * batch.response_mask.float()

    # ------------------------------------------------------------------ update
    def _value_loss(self, mb: TrainBatch, out: torch.Tensor, *, loss: Any, scale: float) -> tuple:
        res = loss(mb, token_values(out, mb.input_ids.shape[1]), None)
        return res.loss * scale, res.metric_tensor()

    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        o = self.owner
        micro, real = mini.shard(o.dp_rank)
        mbs = [mb.to(o.torch_device) for mb in micro]
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_fn = partial(self._value_loss, loss=mini.loss, scale=len(mbs) * o.dp)
        stats = torch.zeros(len(VALUE_METRICS), dtype=torch.float32, device=o.torch_device)
        for i, s in enumerate(o._schedule(self.model, mbs, loss_fn, forward_only=False)):
            if i < real:
                stats += s
        return {k: float(v) for k, v in zip(VALUE_METRICS, o._sum_replicas(stats).cpu())}

    def lr(self, step: int) -> float:
        return self.settings.optim.lr * self.lr_multiplier(step)

    def optimizer_step(self, finite: bool) -> StepResult:
        grad_norm, overflow = self.owner._step(self.optimizer, self.model, finite, self.lr(self.optim_steps))
        if grad_norm is not None:
            self.optim_steps += 1
            self.optimizer.zero_grad()   # its gradients would otherwise stay allocated through the actor's update
            self.model.zero_grad_buffer()
        return StepResult(grad_norm, self.lr(self.optim_steps), overflow)

    # ------------------------------------------------------------------ checkpoint
    def hf_state(self) -> dict[str, torch.Tensor]:
        """The critic as a Hugging Face ForTokenClassification state dict on global rank 0 ({} elsewhere); every
        rank must call (the trunk's tensor shards are gathered, later stages sent to stage 0)."""
        o = self.owner
        local = {k: v for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")}
        head = {k: local.pop(k) for k in list(local) if k.startswith("output_layer.")}
        hf = o._gather_hf(local, trunk_config(self.hf_config))
        if o.pp > 1:   # the head lives on the last stage: send it to stage 0
            group = o.ps.get_pipeline_model_parallel_group()
            src = dist.get_global_rank(group, o.pp - 1)
            for name in ("output_layer.linear.weight", "output_layer.linear.bias"):
                shape = (1, self.hf_config.hidden_size) if name.endswith("weight") else (1,)
                t = (head[name].to(o.torch_device) if name in head
                     else torch.empty(shape, dtype=o.dtype, device=o.torch_device))
                if o.tp_rank == 0 and o.dp_rank == 0:
                    dist.broadcast(t, src=src, group=group)
                head[name] = t
        if not hf:
            return {}
        hf["score.weight"] = head["output_layer.linear.weight"].detach().to("cpu", copy=True)
        hf["score.bias"] = head["output_layer.linear.bias"].detach().to("cpu", copy=True)
        return hf

    def save(self, path: str) -> None:
        config = trunk_config(self.hf_config)
        config.num_labels = 1
        self.owner.write_checkpoint(os.path.join(path, "critic"), self.hf_state(), config, self._ckpt_file(path), {
            "optim_steps": self.optim_steps, "optimizer": self.owner._optimizer_state(self.optimizer)})

    def _ckpt_file(self, path: str) -> str:
        return os.path.join(path, "critic_megatron_optim", f"rank_{dist.get_rank():05d}.pt")

    @torch.no_grad()
    def load(self, path: str) -> None:
        o = self.owner
        folder = os.path.join(path, "critic")
        if not os.path.isdir(folder) or not os.path.isfile(self._ckpt_file(path)):
            raise FileNotFoundError(f"checkpoint {path} has no megatron critic (critic/ and critic_megatron_optim/; "
                                    "it was saved by a run without one, or by another strategy): resume from a "
                                    "checkpoint of this configuration or start fresh")
        extra = torch.load(self._ckpt_file(path), weights_only=True)
        o._check_layout(path, extra["layout"])
        state = hf_megatron.SafetensorsFolder(folder)
        o._load_local(self.model.module, state, trunk_config(self.hf_config), skip=("output_layer.",))
        if hasattr(self.model.module, "output_layer"):
            self.model.module.output_layer.linear.weight.copy_(state["score.weight"])
            self.model.module.output_layer.linear.bias.copy_(state["score.bias"])
        o._load_optimizer_state(self.optimizer, extra["optimizer"])
        self.optim_steps = extra["optim_steps"]


def value_head(state: Any, hf_config: Any, dtype: torch.dtype, tcfg: Any) -> ValueHead:
    """The head from the folder's `score.*` (a critic checkpoint, a reward model), else newly initialised as Hugging
    Face's ...ForTokenClassification head is."""
    head = ValueHead(hf_config.hidden_size, dtype, bool(tcfg.sequence_parallel))
    with torch.no_grad():
        if "score.weight" in state:
            head.linear.weight.copy_(state["score.weight"])
            head.linear.bias.copy_(state["score.bias"] if "score.bias" in state else torch.zeros(1))
        else:
            head.linear.weight.normal_(0.0, float(getattr(hf_config, "initializer_range", 0.02)))
            head.linear.bias.zero_()
    return head


class MegatronRewardModel:
    """reward_model.enable on strategy=megatron: the reward model's folder (a one-label ...ForSequenceClassification,
    trunk + `score` head) as a frozen GPTModel in the actor's layout; a response's score is the head's output at its
    last token (the reward model's own tokens, one row per response), as the torch reward model (reward_model.py)."""

    def __init__(self, owner: Any, cfg: Any):
        rm = cfg.reward_model
        self.owner, self.settings = owner, rm
        self.model, self.hf_config = build_value_model(owner, rm.model.path, rm.model.trust_remote_code, train=False,
                                                       head_key="reward_model.model.path")

    @staticmethod
    def _last_token(mb: TrainBatch, out: torch.Tensor) -> tuple:
        lengths = mb.attention_mask.sum(-1).to(out.device)
        scores = out[torch.arange(len(lengths), device=out.device), lengths - 1, 0].float()
        return scores.new_zeros(()), scores

    def scores(self, batch: TrainBatch) -> torch.Tensor:
        """(B,) scores of `batch` on every rank, in reward_model.* micro-batches."""
        rm = self.settings
        return self.owner.forward_rows(self.model, batch, rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz,
                                       rm.forward_max_token_len_per_gpu, self._last_token, (len(batch),))


def token_values(out: torch.Tensor, length: int) -> torch.Tensor:
    """(B, L, 1) head outputs -> (B, L) values: position t holds the output at t - 1 (0 at t = 0)."""
    return F.pad(out[:, :length - 1, 0].float(), (1, 0))
