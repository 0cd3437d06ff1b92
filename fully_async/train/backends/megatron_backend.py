"""Megatron-core training backend (layer 5): GPTModel with tensor, pipeline and data parallelism.

Every trainer rank builds one backend and is called with the *same* full batch (train/group.ReplicatedGroupBackend):
log-probs take their data-parallel shard here (train/sharding.py's shares; an empty shard runs one zero-weighted row
to stay in step), and the PPO update (train/ppo_update.py) hands each mini-batch already cut into dp shards of
micro-batches (train/sharding.py); each rank runs its own through megatron's pipeline schedule, its unit of
forward/backward.
Each micro-batch loss is divided by its whole mini-batch's token/sequence count (as in TorchBackend); megatron's
schedule divides by the micro-batch count and DDP averages over dp, so the loss given to the schedule is
multiplied back by both.  Log-probs use megatron's vocab-parallel cross-entropy (exact under TP).  Weights enter
and leave in Hugging Face names (`hf_megatron`).  Layers use the local spec (torch fallbacks, no Transformer
Engine/Apex).  On Ascend NPU, MindSpeed patches megatron: `import mindspeed.megatron_adaptor` must run before
megatron is first imported, which `_import_megatron` does when device.name == "npu".  Context parallelism is not
implemented.  The critic of PPO (algorithm.adv_estimator=gae) is a GPTModel of the same layout with a value head
(megatron_critic.py), stepped by this backend's forward_backward / optimizer_step with `which`/`model` "critic".
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import socket
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fully_async.core import safe_write
from fully_async.core.config import FullyAsyncConfig
from fully_async.algorithms.actor_loss import actor_metric_names
from fully_async.algorithms.lr_schedule import lr_lambda, warmup_steps
from fully_async.train.backends import MiniBatch, MicroLoss, StepResult, hf_megatron, lora, megatron_lora
from fully_async.core.batch import TrainBatch, micro_batches
from fully_async.device import Device, parse_dtype
from fully_async.train.sharding import data_parallel_rows

logger = logging.getLogger(__name__)
# float16's first loss scale: megatron's default 2**32 skips ~30 optimizer steps (halving on each overflow, with
# hysteresis) before the first is taken, a large share of an RL run's steps; 2**16 is where fp16 gradients usually fit
FP16_INITIAL_LOSS_SCALE = 2.0 ** 16


def _import_megatron(device: Device) -> None:
    """megatron-core, patched for Ascend by MindSpeed on npu (its adaptor must be imported before megatron is)."""
    if device.name == "npu":
        try:
            import mindspeed.megatron_adaptor  # noqa: F401  (must precede the first megatron import)
        except ImportError as exc:
            raise RuntimeError("actor_rollout_ref.actor.strategy=megatron on trainer.device=npu needs MindSpeed "
                               "(Ascend's megatron adaptor, matching your megatron-core: "
                               f"https://gitee.com/ascend/MindSpeed); import mindspeed.megatron_adaptor failed: {exc}"
                               ) from exc
    import megatron.core  # noqa: F401


def init_parallel(device: Device, mcfg: Any, seed: int) -> None:
    """megatron's parallel_state over the default process group (a world of one is created if none)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(device.comm_backend, rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        vpp = mcfg.virtual_pipeline_model_parallel_size or 1
        ps.initialize_model_parallel(tensor_model_parallel_size=mcfg.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=mcfg.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                     context_parallel_size=mcfg.context_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # megatron's RNG tracker (MindSpeed maps it on npu)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(..., V/tp) logits sharded over the vocab -> (...) entropy of the full softmax."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    m = logits.detach().amax(-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - m
    e = shifted.exp()
    z = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
    ez = tensor_parallel.reduce_from_tensor_model_parallel_region((e * shifted).sum(-1))
    return z.log() - ez / z                                                   # log Z - E_p[shifted]


def vocab_parallel_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                             with_entropy: bool = False, entropy_grad: bool = False
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, L, V/tp) logits, (B, L) ids -> (B, L) log p(ids[t] | <t) at logits / temperature (0 at t = 0)."""
    from megatron.core import tensor_parallel

    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)  # (B, L-1, V/tp), fresh
    ent = None
    if with_entropy:  # before the cross-entropy, which works in place on its input
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = F.pad(vocab_parallel_entropy(scaled), (1, 0))
    target = scaled.clone() if ent is not None and ent.requires_grad else scaled
    logp = -tensor_parallel.vocab_parallel_cross_entropy(target, input_ids[:, 1:].contiguous())  # (B, L-1)
    return F.pad(logp, (1, 0)), ent


def chunks_of(model: Any) -> list:
    """A model's chunks: the list itself, or the one model."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


class MegatronBackend:
    def __init__(self, cfg: FullyAsyncConfig, device: Device, total_optimizer_steps: int):
        arr = cfg.actor_rollout_ref
        self.cfg, self.actor_cfg, self.device, self.mcfg = cfg, arr.actor, device, arr.actor.megatron
        self.dtype = parse_dtype(arr.actor.dtype)   # float16: loss scaling (_build_optimizer); config.validate
        #                                             rejects context parallelism
        if not device.is_accelerator:
            raise RuntimeError("actor_rollout_ref.actor.strategy=megatron needs trainer.device=cuda or npu: "
                               "megatron-core's forward does not run on CPU (use strategy=torch there)")
        _import_megatron(device)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device.set_device(local_rank)
        self.torch_device = device.torch_device(local_rank)
        torch.manual_seed(cfg.trainer.seed)
        init_parallel(device, self.mcfg, cfg.trainer.seed)
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.ps = ps
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.pp, self.pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        # model chunks per rank (virtual pipeline stages, megatron's interleaved schedule): chunk v of pipeline rank
        # p is block v * pp + p of the pp * vpp layer blocks
        self.vpp = self.mcfg.virtual_pipeline_model_parallel_size or 1
        self.hf_config = AutoConfig.from_pretrained(arr.model.path, trust_remote_code=arr.model.trust_remote_code)
        self.tcfg = self._transformer_config()
        hf_state = hf_megatron.SafetensorsFolder(arr.model.path)
        self.lora = lora.lora_settings(arr.model)      # (rank, alpha, targets, excludes) or None: megatron_lora.py
        # the actor's chunks, DDP(GPTModel) each (one without virtual stages); self.model is the first
        self.chunks = [self._build_model(hf_state, train=True, vp=v) for v in range(self.vpp)]
        self.model = self.chunks[0]
        need_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        # with LoRA the reference is the actor with its adapters off (no second copy), as verl's
        self.ref_chunks = ([self._build_model(hf_state, train=False, vp=v) for v in range(self.vpp)]
                           if need_ref and self.lora is None else None)
        self.ref_model = self.ref_chunks[0] if self.ref_chunks else None
        a = arr.actor
        self.optimizer = self._build_optimizer(self.chunks, a.optim.lr, a.optim.weight_decay, a.optim.betas,
                                               a.grad_clip)
        from fully_async.core.config import uses_critic
        from fully_async.train.backends.megatron_critic import MegatronCritic, MegatronRewardModel

        self.critic = MegatronCritic(self, cfg, total_optimizer_steps) if uses_critic(cfg) else None
        self.reward_model = MegatronRewardModel(self, cfg) if cfg.reward_model.enable else None
        optim = arr.actor.optim
        self.warmup_steps = warmup_steps(optim, total_optimizer_steps)
        self.lr_multiplier = lr_lambda(optim, total_optimizer_steps)    # step -> multiplier of optim.lr
        self.temperature = arr.rollout.temperature
        self.data_parallel_size = self.dp                # train/ppo_update cuts each mini-batch into dp shards
        self.rng = random.Random(cfg.trainer.seed)      # the PPO update's shuffle (rank 0's drives the group)
        self.optim_steps = self.num_bad_steps = 0        # good optimizer steps / skipped ones (non-finite)
        self.consecutive_bad_steps = 0                   # reset by every good optimizer step (ppo_update counts)
        self._host: list[tuple[Any, Optional[torch.Tensor], int]] = []   # offloaded device storages

    # ------------------------------------------------------------------ construction
    def _transformer_config(self, hf_config: Any = None) -> Any:
        """The TransformerConfig of `hf_config` (default: the actor's model) in this backend's layout."""
        from megatron.core.transformer import TransformerConfig
        from omegaconf import OmegaConf

        m = self.mcfg
        kwargs = hf_megatron.transformer_config_kwargs(hf_config or self.hf_config, self.dtype)
        kwargs.update(tensor_model_parallel_size=m.tensor_model_parallel_size,
                      pipeline_model_parallel_size=m.pipeline_model_parallel_size,
                      virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
                      context_parallel_size=m.context_parallel_size,
                      sequence_parallel=bool(m.sequence_parallel and m.tensor_model_parallel_size > 1),
                      use_cpu_initialization=True, perform_initialization=False,  # weights come from HF
                      # pipeline p2p of micro-batches of any length; megatron accepts that only with this
                      # (MoE-only) dispatcher set, even for a dense model.  Not with virtual stages: there a step
                      # sends to the next and the previous stage at once, which at pp=2 are one peer, and megatron
                      # exchanges the two shapes (and, batched, the two tensors) over one communicator, where
                      # NCCL matches them in posting order, swapped.  Its interleaved schedule therefore gets one
                      # shape for every micro-batch (_schedule pads them) and unbatched p2p, which at pp=2 sends
                      # the two directions over two communicators (as verl's batch_p2p_comm=False)
                      variable_seq_lengths=self.vpp == 1, batch_p2p_comm=self.vpp == 1,
                      moe_token_dispatcher_type="alltoall")
        from fully_async.train.recompute import gradient_checkpointing

        if gradient_checkpointing(self.cfg, self.device):
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        override = m.override_transformer_config
        kwargs.update(OmegaConf.to_container(override) if OmegaConf.is_config(override) else (override or {}))
        return TransformerConfig(**kwargs)

    def _stage(self, vp: Optional[int]) -> tuple[int, int]:
        """(block, blocks): chunk `vp`'s place among the pp x vpp layer blocks (this rank's stage of pp without
        virtual stages)."""
        return ((vp or 0) * self.pp + self.pp_rank, self.pp * self.vpp)

    def _build_model(self, hf_state: Mapping[str, torch.Tensor], train: bool, hf_config: Any = None,
                     tcfg: Any = None, head: Optional[Callable[[torch.nn.Module], None]] = None,
                     vp: Optional[int] = None) -> torch.nn.Module:
        """GPTModel of `hf_config` (default: the actor's) with this rank's slice of `hf_state` (model chunk `vp`
        with virtual pipeline stages); `head(model)` replaces the last stage's output layer (the critic's value
        head), which is then not loaded from HF."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        hf_config, tcfg = hf_config or self.hf_config, tcfg or self.tcfg
        spec = get_gpt_layer_local_spec(qk_layernorm=hf_megatron.has_qk_norm(hf_config), normalization="RMSNorm")
        virtual = {} if self.vpp == 1 else dict(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(tcfg, spec, pre_process=self.ps.is_pipeline_first_stage(**virtual),
                         post_process=self.ps.is_pipeline_last_stage(**virtual), parallel_output=True,
                         **({} if self.vpp == 1 else {"vp_stage": vp}), **hf_megatron.gpt_model_kwargs(hf_config))
        if head is not None:
            head(model)
        self._load_local(model, hf_state, hf_config, skip=("output_layer.",) if head is not None else (), vp=vp)
        if train and head is None and self.lora is not None:
            self._add_adapters(model, vp)
        model.to(self.torch_device)
        if not train:
            return model.eval().requires_grad_(False)
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.mcfg.use_distributed_optimizer)
        tcfg.finalize_model_grads_func = finalize_model_grads  # dp all-reduce (+ tied-embedding, SP-norm grads)
        return DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=model, disable_bucketing=bool(vp))

    def _add_adapters(self, model: torch.nn.Module, vp: Optional[int]) -> None:
        """The actor's LoRA layers (megatron_lora.py), from lora_adapter_path's adapter when one is given."""
        arr = self.cfg.actor_rollout_ref
        offset = hf_megatron._stage_layers(self.hf_config, *self._stage(vp)).start
        megatron_lora.apply_lora(
            model, self.lora, arr.model.lora_A_init_method or "xavier", self.cfg.trainer.seed, offset, self.tp_rank,
            self.tp, self.tcfg.sequence_parallel)
        if arr.model.lora_adapter_path:
            self._load_adapter(model, arr.model.lora_adapter_path, vp)

    def _load_adapter(self, model: torch.nn.Module, folder: str, vp: Optional[int],
                      state: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Chunk `vp`'s adapters from the peft adapter in `folder` (its tensors `state` when already read)."""
        from safetensors.torch import load_file

        state = state if state is not None else load_file(os.path.join(folder, lora.ADAPTER_WEIGHTS))
        wanted = sorted(megatron_lora.lora_layers(model))
        megatron_lora.load_local(model, megatron_lora.peft_to_local(
            state, wanted, self.hf_config, self.tp_rank, self.tp, *self._stage(vp), folder))

    def _load_local(self, model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], hf_config: Any = None,
                    skip: tuple[str, ...] = (), vp: Optional[int] = None) -> None:
        """Copy this rank's slice of a full HF state dict into `model` (in place: DDP views survive); parameters
        whose names start with a prefix in `skip` are not read (the critic's value head)."""
        state = hf_megatron.hf_to_megatron(hf_state, hf_config or self.hf_config, self.tp_rank, self.tp,
                                           *self._stage(vp), lm_head=not skip)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith(skip)]
        if missing or unexpected:
            raise RuntimeError(f"HF -> megatron conversion does not match GPTModel: missing {missing}, "
                               f"unexpected {unexpected}")

    def _build_optimizer(self, model: Any, lr: float, weight_decay: float, betas: Any, grad_clip: float) -> Any:
        """One optimizer over `model` (a DDP model or its chunks): fp32 master weights, TP/PP-aware clipping; states sharded over dp with use_distributed_optimizer.
        Without Apex/TE the inner optimizer is torch.optim.AdamW (no weight decay on norms/biases).  float16:
        megatron's dynamic loss scaling, from FP16_INITIAL_LOSS_SCALE; the schedule scales each loss by it."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        fp16 = self.dtype == torch.float16
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
            clip_grad=grad_clip, bf16=self.dtype == torch.bfloat16, fp16=fp16, params_dtype=self.dtype,
            initial_loss_scale=FP16_INITIAL_LOSS_SCALE, use_distributed_optimizer=self.mcfg.use_distributed_optimizer),
            chunks_of(model))
        if fp16:
            from megatron.core.utils import get_model_config

            get_model_config(chunks_of(model)[0]).grad_scale_func = optimizer.scale_loss
        return optimizer

    # ------------------------------------------------------------------ forward plumbing
    def _dp_rows(self, batch: TrainBatch) -> tuple[list[int], float]:
        """This data-parallel rank's rows of `batch` (sharding.data_parallel_rows: token-balanced with
        trainer.balance_batch, else r::dp) and their weight; an empty share runs row 0 weighted 0."""
        rows = data_parallel_rows(batch.seq_lengths, self.dp, self.cfg.trainer.balance_batch)[self.dp_rank]
        return (rows, 1.0) if rows else ([0], 0.0)

    def _forward_step(self, loss_fn: Callable, shape: Optional[tuple[int, int]], data_iterator: Iterator[TrainBatch],
                      model: Any) -> tuple:
        """One micro-batch through `model`; `shape` (rows, length): the input padded to it (virtual stages), the
        last stage's output cut back to the micro-batch before its loss."""
        mb = next(data_iterator)
        ids = mb.input_ids                                                       # (B, L), right-padded
        if shape is not None:
            ids = F.pad(ids, (0, shape[1] - ids.shape[1], 0, shape[0] - ids.shape[0]))
        elif self.tcfg.sequence_parallel:
            ids = F.pad(ids, (0, (-ids.shape[1]) % self.tp))
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        out = model(ids, positions, None)   # causal mask built inside; (B, L, V/tp) on the last stage
        if shape is None:
            return out, partial(loss_fn, mb)
        return out, lambda logits: loss_fn(mb, logits[:mb.input_ids.shape[0]])

    def _schedule(self, model: Any, mbs: list[TrainBatch], loss_fn: Callable, forward_only: bool) -> list:
        """Megatron's (pipelined) schedule over micro-batches of `model` (a model or its chunks); loss_fn outputs,
        on the last stage only, for the given micro-batches first.  The interleaved schedule (chunks) runs a multiple
        of pp micro-batches: the list is padded with zero-mask copies of the first, whose outputs come last."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = chunks_of(model)
        mbs = self._padded(mbs, len(chunks))
        seq = max(mb.input_ids.shape[1] for mb in mbs)
        seq, rows = seq + (-seq) % self.tp, max(map(len, mbs))
        data = [iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs)   # every chunk reads each micro-batch
        shape = (rows, seq) if len(chunks) > 1 else None   # one shape for the interleaved schedule (_transformer_config)
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn, shape), data_iterator=data, model=chunks,
            num_microbatches=len(mbs), seq_length=seq, micro_batch_size=rows, forward_only=forward_only)

    def _padded(self, mbs: list[TrainBatch], num_chunks: int) -> list[TrainBatch]:
        """`mbs` as the schedule runs them: with model chunks, padded to a multiple of pp with zero-mask copies of
        the first (megatron's interleaved schedule runs groups of pp micro-batches)."""
        from fully_async.train.sharding import masked

        if num_chunks == 1 or len(mbs) % self.pp == 0:
            return mbs
        return mbs + [masked(mbs[0])] * (self.pp - len(mbs) % self.pp)

    def _sum_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel shards and pipeline stages (only the last stage holds outputs)."""
        if self.dp > 1:
            dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        if self.pp > 1:
            dist.all_reduce(t, group=self.ps.get_pipeline_model_parallel_group())
        return t

    # ------------------------------------------------------------------ log-probs
    def _logp_only(self, mb: TrainBatch, logits: torch.Tensor) -> tuple:
        logp, _ = vocab_parallel_log_probs(logits[:, :mb.input_ids.shape[1]], mb.input_ids, self.temperature)
        return logp.new_zeros(()), logp

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        """(B, L) log-probs of `batch` under the actor or the frozen reference, on every rank."""
        arr = self.cfg.actor_rollout_ref
        sub = arr.rollout if which == "actor" else arr.ref
        model = self.chunks if which == "actor" or self.lora is not None else self.ref_chunks
        if model is None:
            raise RuntimeError("reference log-probs requested but no reference model was built")
        base = which != "actor" and self.lora is not None     # LoRA: the reference is the base model
        with megatron_lora.adapters_disabled(*model) if base else contextlib.nullcontext():
            return self.forward_rows(model, batch, sub.log_prob_micro_batch_size_per_gpu,
                                     sub.log_prob_use_dynamic_bsz, sub.log_prob_max_token_len_per_gpu,
                                     self._logp_only, batch.input_ids.shape)

    @torch.no_grad()
    def forward_rows(self, model: Any, batch: TrainBatch, micro: Optional[int], dynamic: bool, budget: int,
                     fn: Callable, shape: Any) -> torch.Tensor:
        """A forward-only pass of `model` (the actor, the reference, the critic, the reward model) over this rank's
        data-parallel rows of `batch`, in micro-batches of `micro` rows (or `budget` tokens with `dynamic`);
        `fn(micro-batch, output) -> (0, per-row results)`.  The results of every row, in a float32 tensor of `shape`
        (rows first; shorter rows padded with 0), on every rank: summed over dp shards and pipeline stages."""
        rows, weight = self._dp_rows(batch)
        shard = batch.select(rows)
        splits = micro_batches(shard, micro, dynamic, budget)
        chunks = chunks_of(model)
        was_training = chunks[0].training
        for chunk in chunks:
            chunk.eval()
        outs = self._schedule(chunks, [shard.select(i).to(self.torch_device) for i in splits], fn, True)
        for chunk in chunks:
            chunk.train(was_training)
        out = torch.zeros(shape, dtype=torch.float32, device=self.torch_device)
        for idx, res in zip(splits, outs if weight else []):      # outs is empty except on the last stage
            target = [rows[i] for i in idx]
            if res.dim() > 1:
                out[target, :res.shape[1]] = res.float()
            else:
                out[target] = res.float()
        return self._sum_replicas(out).cpu()

    # ------------------------------------------------------------------ update (driven by train/ppo_update.py)
    def _ppo_loss(self, mb: TrainBatch, logits: torch.Tensor, *, loss: MicroLoss, scale: float) -> tuple:
        logp, ent = vocab_parallel_log_probs(logits[:, :mb.input_ids.shape[1]], mb.input_ids, self.temperature,
                                             with_entropy=True, entropy_grad=self.actor_cfg.entropy_coeff != 0)
        res = loss(mb, logp, ent)
        # the schedule divides by the micro-batch count and DDP averages over dp: `scale` undoes both
        return res.loss * scale, res.metric_tensor()          # metrics in actor_metric_names order

    def _lr(self, step: int) -> float:
        return self.actor_cfg.optim.lr * self.lr_multiplier(step)

    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        """Megatron's (pipelined) schedule over this data-parallel rank's micro-batches of `mini`, from zero
        gradients; the metrics of the real micro-batches summed over dp shards and pipeline stages (identical on
        every rank from here on).  A rank without rows of its own runs a zero-mask row (sharding.py).  A critic
        mini-batch (`mini.model`) goes to the critic."""
        if mini.model == "critic":
            return self._critic().forward_backward(mini)
        micro, real = mini.shard(self.dp_rank)
        mbs = [mb.to(self.torch_device) for mb in micro]
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        keys = actor_metric_names(self.actor_cfg, self.cfg.async_training,
                                  rollout_correction=self.cfg.algorithm.rollout_correction)
        # megatron divides each loss by the scheduled micro-batch count (padding included)
        loss_fn = partial(self._ppo_loss, loss=mini.loss, scale=len(self._padded(mbs, self.vpp)) * self.dp)
        stats = torch.zeros(len(keys), dtype=torch.float32, device=self.torch_device)
        for i, s in enumerate(self._schedule(self.chunks, mbs, loss_fn, forward_only=False)):
            if i < real:                                 # outputs exist on the last pipeline stage only
                stats += s
        return {k: float(v) for k, v in zip(keys, self._sum_replicas(stats).cpu())}

    def _critic(self) -> Any:
        if self.critic is None:
            raise RuntimeError("values requested but no critic was built (algorithm.adv_estimator=gae or "
                               "critic.enable=true builds one)")
        return self.critic

    def compute_values(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B, L) values of `batch` under the critic (0 off the response), on every rank (every rank gets the whole
        batch: `num_micro`, the sharded backends' pass count, does not apply)."""
        return self._critic().values(batch)

    def compute_rm_scores(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B,) reward-model scores of `batch` (the reward model's own tokens, one row per response), on every rank."""
        if self.reward_model is None:
            raise RuntimeError("reward-model scores requested but no reward model was built (reward_model.enable)")
        return self.reward_model.scores(batch)

    def optimizer_step(self, finite: bool, which: str = "actor") -> StepResult:
        """Global grad norm over tp/pp(/dp) before clipping; megatron's step clips to grad_clip and copies into
        the params.  The LR follows the schedule by taken steps.  `which`: the actor or the critic."""
        if which == "critic":
            return self._critic().optimizer_step(finite)
        if which != "actor":
            raise ValueError(f"which={which!r} is not 'actor' or 'critic'")
        grad_norm, overflow = self._step(self.optimizer, self.chunks, finite, self._lr(self.optim_steps))
        self.optim_steps += grad_norm is not None
        return StepResult(grad_norm, self._lr(self.optim_steps), overflow)

    def _step(self, optimizer: Any, model: Any, finite: bool, lr: float) -> tuple[Optional[float], bool]:
        """One step of `optimizer` at `lr`: (the global grad norm before clipping, or None when the step was skipped
        and the gradients dropped; whether float16 loss scaling overflowed).  bf16/fp32: a non-finite norm skips.
        float16: megatron's step unscales, checks for inf/nan and updates the loss scale once, then clips and steps;
        an overflow skips the step and lowers the scale (StepResult.overflow: not a bad step)."""
        grad_norm, overflow = None, False
        if finite:
            for group in optimizer.param_groups:
                group["lr"] = lr
            if self.dtype == torch.float16:
                stepped, norm, _ = optimizer.step()
                overflow = not stepped
                grad_norm = float(norm) if stepped and norm is not None and math.isfinite(norm) else None
            else:
                optimizer.prepare_grads()
                norm = float(optimizer.get_grad_norm())
                if math.isfinite(norm):
                    optimizer.step()
                    grad_norm = norm
        if grad_norm is None:
            optimizer.zero_grad()
            for chunk in chunks_of(model):
                chunk.zero_grad_buffer()
        return grad_norm, overflow

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        """Full HF-named CPU tensors on global rank 0 (tp 0, dp 0, first stage); {} on other ranks.

        Collective: every rank calls it (TP shards are all-gathered, later stages sent to stage 0).  LoRA: the
        merged model."""
        if self.lora is not None:
            return self._gather_hf([megatron_lora.merged_local_state(c.module) for c in self.chunks], self.hf_config)
        return self._gather_hf([{k: v for k, v in c.module.state_dict().items() if not k.endswith("_extra_state")}
                                for c in self.chunks], self.hf_config)

    def _gather_tp(self, local: dict[str, torch.Tensor]) -> Optional[list[dict[str, torch.Tensor]]]:
        """Every tensor rank's `local` (CPU copies) on the stage's root (tp 0, dp 0), None elsewhere; collective
        over the tensor ranks."""
        root = self.tp_rank == 0 and self.dp_rank == 0
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        for name in sorted(local):
            parts = [local[name].contiguous()]
            if self.tp > 1:
                parts = [torch.empty_like(parts[0]) for _ in range(self.tp)]
                dist.all_gather(parts, local[name].contiguous(), group=self.ps.get_tensor_model_parallel_group())
            for r, p in enumerate(parts if root else []):
                shards[r][name] = p.to("cpu", copy=True)
        return shards if root else None

    def _gather_chunks(self, locals_: list[dict[str, torch.Tensor]], convert: Callable) -> dict[str, torch.Tensor]:
        """`convert(every tensor rank's state of chunk vp, vp) -> HF-named tensors` of this rank's chunk states
        `locals_`, joined over the chunks and pipeline stages on global rank 0 ({} elsewhere); collective."""
        out: dict[str, torch.Tensor] = {}
        for vp, one in enumerate(locals_):
            shards = self._gather_tp(one)
            if shards is not None:
                out.update(convert(shards, vp))
        if self.tp_rank or self.dp_rank:
            return {}
        return self._gather_stages(out) if self.pp > 1 else out

    def _gather_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter in peft's names on global rank 0 ({} elsewhere); collective."""
        return self._gather_chunks([megatron_lora.adapter_local_state(c.module) for c in self.chunks],
                                   lambda shards, vp: megatron_lora.adapter_to_peft(shards, self.hf_config,
                                                                                    *self._stage(vp)))

    def _gather_hf(self, local: Any, hf_config: Any) -> dict[str, torch.Tensor]:
        """The full HF state dict of a model whose megatron state on this rank is `local` (one dict, or one per
        model chunk), on global rank 0 ({} on the others); collective over every rank."""
        locals_ = local if isinstance(local, list) else [local]
        return self._gather_chunks(locals_, lambda shards, vp: hf_megatron.megatron_to_hf(
            shards, hf_config, *self._stage(vp), lm_head=any(k.startswith("output_layer.") for k in locals_[vp])))

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF names and full shapes in the HF model's named_parameters order (what the engines hold)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        return [(name, tuple(p.shape)) for name, p in model.named_parameters()]

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        """Global rank 0 hands (name, full device tensor) in param_shapes order to `consumer`; every rank
        must call (the gather is collective)."""
        full = self.named_parameters_for_sync()
        if dist.get_rank() != 0 or consumer is None:
            return 0
        return consumer((name, full[name].to(self.torch_device)) for name, _ in self.param_shapes())

    def _gather_stages(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pipeline stages 1.. broadcast their HF tensors over the (tp 0, dp 0) pipeline group to stage 0."""
        group = self.ps.get_pipeline_model_parallel_group()
        out = dict(hf)
        for stage in range(1, self.pp):
            src = dist.get_global_rank(group, stage)
            meta = [[(k, v.shape, v.dtype) for k, v in hf.items()] if self.pp_rank == stage else None]
            dist.broadcast_object_list(meta, src=src, group=group)
            for name, shape, dtype in meta[0]:
                t = (hf[name].to(self.torch_device) if self.pp_rank == stage
                     else torch.empty(shape, dtype=dtype, device=self.torch_device))
                dist.broadcast(t, src=src, group=group)
                if self.pp_rank == 0:
                    out[name] = t.cpu()
        return out if self.pp_rank == 0 else {}

    # ------------------------------------------------------------------ checkpoint
    def _ckpt_file(self, path: str) -> str:
        return os.path.join(path, "actor_megatron_optim", f"rank_{dist.get_rank():05d}.pt")

    def _inner_optimizers(self, optimizer: Any) -> list[torch.optim.Optimizer]:
        """The torch optimizers over this rank's fp32 master params (shards, with the distributed one)."""
        return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]

    def save(self, path: str) -> None:
        """actor/ as a Hugging Face folder (rank 0) + per-rank optimizer/RNG files (resume: same sizes)."""
        self.write_checkpoint(os.path.join(path, "actor"), self.named_parameters_for_sync(), self.hf_config,
                              self._ckpt_file(path), {
                                  "optim_steps": self.optim_steps, "num_bad_steps": self.num_bad_steps,
                                  "py_rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(),
                                  "optimizer": self._optimizer_state(self.optimizer)})
        if self.lora is not None:
            self._save_adapter(os.path.join(path, "actor", "lora_adapter"))
        if self.critic is not None:
            self.critic.save(path)

    def _save_adapter(self, folder: str) -> None:
        """actor/lora_adapter/ in peft's format (Hugging Face module names), next to the merged actor/."""
        state = self._gather_adapter()
        if dist.get_rank() == 0:
            modules = sorted({k[len(lora.PEFT_PREFIX):].split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
            lora.save_adapter(folder, state, *self.lora[:2], modules, self.cfg.actor_rollout_ref.model.path)
        dist.barrier()

    def write_checkpoint(self, folder: str, state: dict[str, torch.Tensor], hf_config: Any, rank_file: str,
                         extra: dict) -> None:
        """Global rank 0 writes `state` (full, HF names) and `hf_config` as a Hugging Face folder; every rank writes
        its `extra` (optimizer shards, counters) with this run's layout to `rank_file`; then all wait for all."""
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(rank_file), exist_ok=True)
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"),
                      metadata={"format": "pt"})
            hf_config.save_pretrained(folder)
        safe_write.torch_save({**extra, "layout": (self.tp, self.pp, self.dp)}, rank_file)
        dist.barrier()

    def _optimizer_state(self, optimizer: Any) -> list[dict]:
        """The inner torch optimizers' states and master params as they are on this rank (megatron's own dp-zero
        parameter-state files do not round-trip torch's AdamW "step" state)."""
        return [{"state": o.state_dict(), "main": [p.detach().cpu() for g in o.param_groups for p in g["params"]]}
                for o in self._inner_optimizers(optimizer)]

    @torch.no_grad()
    def _load_optimizer_state(self, optimizer: Any, saved: list[dict]) -> None:
        for inner, one in zip(self._inner_optimizers(optimizer), saved):
            inner.load_state_dict(one["state"])
            for p, value in zip((p for g in inner.param_groups for p in g["params"]), one["main"]):
                p.copy_(value)                           # fp32 masters (the bf16 params are their rounding)

    def _check_layout(self, path: str, layout: Any) -> None:
        if tuple(layout) != (self.tp, self.pp, self.dp):
            raise RuntimeError(f"checkpoint {path} was written with (tp, pp, dp)={tuple(layout)} but this "
                               f"run has {(self.tp, self.pp, self.dp)}: resume with the same actor.megatron sizes")

    @torch.no_grad()
    def load(self, path: str) -> None:
        extra = torch.load(self._ckpt_file(path), weights_only=True)
        self._check_layout(path, extra["layout"])
        if self.lora is not None:      # actor/ is the merged model; the base stays the model's own, the adapter goes on
            from safetensors.torch import load_file

            folder = os.path.join(path, "actor", "lora_adapter")
            state = load_file(os.path.join(folder, lora.ADAPTER_WEIGHTS))
            for vp, chunk in enumerate(self.chunks):
                self._load_adapter(chunk.module, folder, vp, state)
        else:
            saved = hf_megatron.SafetensorsFolder(os.path.join(path, "actor"))
            for vp, chunk in enumerate(self.chunks):
                self._load_local(chunk.module, saved, vp=vp)
        self._load_optimizer_state(self.optimizer, extra["optimizer"])
        if self.critic is not None:
            self.critic.load(path)
        self.optim_steps, self.num_bad_steps = extra["optim_steps"], extra["num_bad_steps"]
        self.rng.setstate(extra["py_rng"])
        torch.set_rng_state(extra["torch_rng"])

    # ------------------------------------------------------------------ memory
    def memory_parts(self) -> dict[str, int]:
        """Bytes this rank holds on its device (device_memory/tenant.py): weights (params and DDP's contiguous param
        buffers, the reference and reward models), grads (DDP's grad buffers), optimizer (fp32 masters and moments);
        0 each while offloaded."""
        from fully_async.device_memory.tenant import held_bytes, optimizer_tensors

        trained = [(self.chunks, self.optimizer)] + ([(self.critic.model, self.critic.optimizer)] if self.critic else [])
        weights: list = []
        grads: list = []
        optim: list = []
        for model, optimizer in trained:
            for chunk in chunks_of(model):
                weights += list(chunk.parameters())
                for buf in chunk.buffers:
                    weights.append(getattr(buf, "param_data", None))
                    grads.append(buf.grad_data)
            for inner in self._inner_optimizers(optimizer):
                optim += [p for group in inner.param_groups for p in group["params"]]
                optim += list(optimizer_tensors(inner))
        for frozen in (self.ref_chunks or []) + ([self.reward_model.model] if self.reward_model is not None else []):
            weights += list(frozen.parameters())
        return held_bytes({"weights": weights, "grads": grads, "optimizer": optim}, self.torch_device.type)

    # ------------------------------------------------------------------ offload
    def offload(self) -> None:
        """Free the device storage of params, grad buffers, optimizer masters/states (the actor's and the critic's),
        the reference and the reward model, keeping host copies (grad buffers are re-zeroed instead).  Every view
        keeps its storage."""
        if not self.device.is_accelerator or self._host:
            return
        tensors: list[tuple[Any, bool]] = []
        trained = [(self.chunks, self.optimizer)] + ([(self.critic.model, self.critic.optimizer)] if self.critic else [])
        for model, optimizer in trained:
            for chunk in chunks_of(model):
                tensors += [(p, True) for p in chunk.parameters()]
                for buf in chunk.buffers:                        # DDP's contiguous param/grad buffers
                    tensors += [(buf.grad_data, False), (getattr(buf, "param_data", None), True)]
            for inner in self._inner_optimizers(optimizer):
                tensors += [(p, True) for group in inner.param_groups for p in group["params"]]
                tensors += [(v, True) for st in inner.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor)]
        for frozen in (self.ref_chunks or []) + ([self.reward_model.model] if self.reward_model is not None else []):
            tensors += [(p, True) for p in frozen.parameters()]
        seen: dict[int, tuple[Any, Optional[torch.Tensor], int]] = {}
        for t, keep in tensors:
            if t is None or t.device.type == "cpu" or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                seen[storage.data_ptr()] = (storage, data.to("cpu") if keep else None, storage.nbytes())
        for storage, _, _ in seen.values():
            storage.resize_(0)
        self._host = list(seen.values())
        self.device.empty_cache()

    def onload(self) -> None:
        for storage, host, nbytes in self._host:
            storage.resize_(nbytes)
            data = torch.empty(0, dtype=torch.uint8, device=self.torch_device).set_(storage)
            data.copy_(host) if host is not None else data.zero_()
        self._host = []
