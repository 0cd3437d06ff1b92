"""Torch training backend, one device or an FSDP2 rank (layer 5): log-probs, the PPO primitives, weights for sync.

The PPO loop is train/ppo_update.py; this backend runs its two primitives.  `forward_backward` runs a
mini-batch's micro-batches (each loss already divided by its whole mini-batch's token or sequence count, so
micro-batching never changes the numbers) with gradients accumulating; `optimizer_step` clips, checks the global
grad norm and steps the optimizer and the LR schedule once per mini-batch, or drops the gradients when the loss
or the norm is non-finite.  Under FSDP2 every rank runs the same number of passes (sharding.py pads with dummies)
so that the all-gathers line up.
"""
from __future__ import annotations

import copy
import glob
import logging
import os
import random
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fully_async.core import safe_write
from fully_async.core.config import (FullyAsyncConfig, actor_strategy, keeps_gathered_layers, sequence_parallel_size,
                                     uses_critic)
from fully_async.algorithms.lr_schedule import lr_lambda, warmup_steps
from fully_async.core import varlen_attention
from fully_async.train.backends import MiniBatch, StepResult, fsdp, lora, ulysses
from fully_async.train.backends.token_stats import enable_fused_head, sum_pi_squared, token_stats
from fully_async.core.batch import PackedRows, TrainBatch, micro_batches
from fully_async.device import Device, parse_dtype

logger = logging.getLogger(__name__)
varlen_attention.register()


def model_inputs(batch: TrainBatch, packed: bool) -> tuple[dict[str, Any], torch.Tensor, Callable]:
    """(forward keyword arguments, the (B, L) or packed (1, T) input ids, to_rows) of `batch`.

    packed (model.use_remove_padding): the rows' real tokens go back to back in one (1, T) row with
    position_ids restarting at 0 per sequence and no attention mask; transformers then keeps the
    sequences apart: the sequence boundaries go along as FlashAttentionKwargs (used by "varlen" and
    flash_attention_2), and sdpa/eager build a block-diagonal mask from the positions.  No pad
    token is computed.  `to_rows(values)` takes per-position outputs (flattened, in the inputs' layout), shifts
    them one position right (position t gets the output of position t - 1: what was known before token t) and
    scatters them back to the padded (B, L) layout."""
    mask = batch.attention_mask
    if packed:
        rows = batch.packing or PackedRows.of(mask)   # worked out on the host where to(pack=True) ran
        ids, pos = batch.input_ids.reshape(-1).index_select(0, rows.index)[None], rows.positions[None]   # (1, T)
        inputs = dict(input_ids=ids, position_ids=pos, use_cache=False, **rows.kwargs())
    else:
        ids = batch.input_ids
        inputs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                      use_cache=False)

    def to_rows(values: torch.Tensor) -> torch.Tensor:
        values = torch.nn.functional.pad(values.view(ids.shape)[:, :-1], (1, 0))
        if not packed:
            return values
        # a sequence's first position would get the previous sequence's last output: not a real value
        values = values[0].masked_fill(pos[0] == 0, 0.0)
        return values.new_zeros(mask.numel()).index_copy(0, rows.index, values).view(mask.shape)

    return inputs, ids, to_rows


def token_log_probs(model: torch.nn.Module, batch: TrainBatch, temperature: float,
                    with_entropy: bool = False, packed: bool = False, fused: bool = False,
                    compiled: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, L) log p(input_ids[t] | <t) at logits / temperature (0 at t = 0), and optionally entropy.

    packed (model.use_remove_padding): one packed row, no pad token computed (model_inputs); results are
    scattered back to the padded (B, L) layout.
    fused (model.use_fused_kernels, a model prepared by token_stats.enable_fused_head): the model returns
    the per-token values from its hidden states and lm_head weight; no logits tensor exists whole.
    compiled: token_stats' chunk math compiled (the trainer's device decides; None: where the logits are on CUDA).
    Under sequence parallelism (ulysses.setup) this rank computes its slice of the packed row and the values are
    gathered over its group."""
    inputs, targets, gather, to_rows = _model_pass(model, batch, packed)
    temperature = temperature if temperature > 0 else 1.0
    if fused:
        logp, ent = model(**inputs, fa_targets=targets, fa_temperature=temperature, fa_with_entropy=with_entropy)
    else:
        logits = model(**inputs).logits
        logp, ent = token_stats(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), temperature, with_entropy,
                                compiled=compiled)
    return to_rows(gather(logp)), (to_rows(gather(ent)) if with_entropy else None)


def _model_pass(model: torch.nn.Module, batch: TrainBatch, packed: bool) -> tuple[dict[str, Any], torch.Tensor,
                                                                               Callable, Callable]:
    """(inputs, targets, gather, to_rows) of one forward pass of `model` over `batch` on this rank: row t of the
    logits predicts token t + 1 (the last row's wrapped target is dropped by to_rows); under sequence parallelism
    this rank's slice, `gather` joining the group's."""
    inputs, ids, to_rows = model_inputs(batch, packed)
    inputs, targets, gather = sequence_split(model, inputs, torch.roll(ids, -1, dims=1))
    return inputs, targets, gather, to_rows


@torch.no_grad()
def token_sum_pi_squared(model: torch.nn.Module, batch: TrainBatch, temperature: float, packed: bool = False,
                         fused: bool = False) -> torch.Tensor:
    """(B, L) sum_v pi_v^2 of the distribution that predicted input_ids[t] (0 at t = 0), at logits / temperature:
    actor.calculate_sum_pi_squared, for the optimal-token-baseline estimators (token_stats.sum_pi_squared)."""
    inputs, _, gather, to_rows = _model_pass(model, batch, packed)
    temperature = temperature if temperature > 0 else 1.0
    if fused:
        values = model(**inputs, fa_temperature=temperature, fa_sum_pi_squared=True)
    else:
        logits = model(**inputs).logits
        values = sum_pi_squared(logits.reshape(-1, logits.shape[-1]), temperature)
    return to_rows(gather(values))


def sequence_split(model: torch.nn.Module, inputs: dict[str, Any], targets: torch.Tensor
                   ) -> tuple[dict[str, Any], torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(inputs, targets, gather) of this rank for `model`: its slice of the packed row where the model attends
    with "ulysses" (ulysses.split_packed), else all of it (gather: identity)."""
    sp = ulysses.current()
    if sp is None or getattr(model.config, "_attn_implementation", None) != ulysses.NAME:
        return inputs, targets, lambda values: values
    return ulysses.split_packed(inputs, targets, sp)


def model_overrides(model_cfg: Any, device: Device, sp: int = 1, own: Optional[dict] = None) -> dict[str, Any]:
    """from_pretrained keyword arguments: actor_rollout_ref.model.override_config (HF config fields), then `own`
    (a critic's or reward model's override_config), and the attention kernel (their attn_implementation, else the
    device's choice, see device.py).  sp > 1 (Ulysses, after every rank called ulysses.setup with the actor's
    kernel): "ulysses", which runs that kernel per head group, whatever `own` says."""
    overrides = dict(model_cfg.override_config or {})
    overrides.update(own or {})
    overrides.setdefault("attn_implementation", device.attn_implementation(model_cfg.use_remove_padding))
    if sp > 1:
        overrides["attn_implementation"] = ulysses.NAME
    return overrides


def pad_micro_batches(splits: list[list[int]], num_micro: Optional[int]) -> list[tuple[list[int], bool]]:
    """Micro-batches flagged (idx, is_dummy), padded with dummies to `num_micro` passes."""
    out = [(idx, False) for idx in splits]
    if num_micro is not None:
        if len(out) > num_micro:
            raise ValueError(f"{len(out)} micro-batches but the ranks agreed on {num_micro}")
        out += [(splits[0][:1], True)] * (num_micro - len(out))
    return out


def compile_decoder_layers(model: torch.nn.Module, device: Device) -> bool:
    """actor.use_torch_compile: torch.compile each decoder layer in place (one program shared by all layers; the
    token count becomes dynamic after the second size seen).  Measured on one H100, 0.5B shape, packed update:
    1.3-1.6x tokens/s and less peak memory (scripts/bench_packing.py `/compiled`).  False, changing nothing,
    where the device has no compile backend or the model no `.layers` list."""
    backend = device.compile_backend()
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if backend is None or not isinstance(layers, torch.nn.ModuleList):
        return False
    if device.name == "cuda":
        varlen_attention.resolve_packed_kernel(device.torch_device())   # decided before the layers are traced
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
    return True


def load_hf_weights(model: torch.nn.Module, folder: str) -> None:
    """Load the *.safetensors of a Hugging Face folder into `model`; every key must match (tied weights may be
    missing)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"checkpoint folder {folder} has no *.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")


class TorchBackend:
    def __init__(self, cfg: FullyAsyncConfig, device: Device, total_optimizer_steps: int):
        from transformers import AutoModelForCausalLM

        arr = cfg.actor_rollout_ref
        self.cfg = cfg
        self.actor_cfg = arr.actor
        self.device = device
        self.torch_device = device.torch_device()
        torch.manual_seed(cfg.trainer.seed)
        self.fsdp = actor_strategy(cfg) == "fsdp2"
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # FSDP2 ranks are one process group; plain torch is a world of one.  With Ulysses the sp consecutive ranks of
        # a group share a data-parallel shard (ulysses.py): world / sp shards, gradients scaled by the whole world
        self.sp = sequence_parallel_size(cfg)
        self.world = dist.get_world_size() if self.fsdp and dist.is_initialized() else 1
        self.data_parallel_size = self.world // self.sp
        self.dp_rank = self.rank // self.sp if self.fsdp else 0
        self.reports = self.rank % self.sp == 0   # the group's first rank reports the (identical) metrics
        compute_dtype = parse_dtype(arr.actor.dtype)
        # FSDP2 keeps float32 master weights and computes in actor.dtype; plain torch trains in actor.dtype
        self.packed = arr.model.use_remove_padding
        self._host: Optional[Any] = None   # pinned host buffers of offload(), made at the first one
        if self.sp > 1:   # every rank joins its group before any model uses the "ulysses" attention
            ulysses.setup(self.sp, model_overrides(arr.model, device)["attn_implementation"])
        self.model = AutoModelForCausalLM.from_pretrained(
            arr.model.path, dtype=torch.float32 if self.fsdp else compute_dtype,
            trust_remote_code=arr.model.trust_remote_code, **model_overrides(arr.model, device, self.sp)
        ).to(self.torch_device)
        from fully_async.train.recompute import gradient_checkpointing

        if gradient_checkpointing(cfg, device):   # non-reentrant, as verl: torch.compile traces through it
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        need_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if need_ref else None
        # LoRA: adapters on the frozen actor (the reference above is the base model), from a saved adapter or fresh
        self.lora = lora.lora_settings(arr.model)
        self.lora_targets: list[str] = []
        if self.lora is not None:
            self.lora_targets = lora.apply_lora(self.model, *self.lora, init=arr.model.lora_A_init_method or "kaiming")
            if arr.model.lora_adapter_path:
                lora.load_adapter(self.model, arr.model.lora_adapter_path)
        # lm_head folded into the chunked log-prob/entropy (no logits tensor), where the model allows it
        # the chunked log-prob math compiles where this device compiles (trainer.device=npu: never, as on Ascend)
        self.chunk_compiled = device.compile_backend() is not None
        self.fused = arr.model.use_fused_kernels and all(
            enable_fused_head(m, self.chunk_compiled) for m in (self.model, self.ref_model) if m is not None)
        if arr.model.use_fused_kernels and not self.fused:
            logger.warning("actor_rollout_ref.model.use_fused_kernels: %s's logits are not a plain lm_head projection "
                           "(bias, soft-capping or scaling); computing full logits", arr.model.path)
        # fsdp2 with offload_policy on an accelerator: every model's shards, grads and AdamW states stay in host
        # memory (the critic and reward model shard the same way); offload()/onload() then have nothing to move
        self.host_resident = self.fsdp and arr.actor.fsdp_config.offload_policy and device.is_accelerator
        self.keep_gathered = False   # fsdp2: the actor's layers stay gathered from forward to backward (below)
        if self.fsdp:
            if not dist.is_initialized():
                raise RuntimeError("strategy=fsdp2 needs the trainer's process group (fully_async.train.group)")
            # host-resident shards while training (verl's offload_policy; on CPU they are there already);
            # param_offload is the move between phases (offload/onload)
            offload = self.host_resident
            mesh = fsdp.shard_mesh(self.torch_device.type, arr.actor.fsdp_config.fsdp_size)   # None: full sharding
            # every layer's weights in the compute dtype: what keeping them gathered costs (keeps_gathered_layers)
            gathered = sum(p.numel() for layer in fsdp.decoder_layers(self.model) for p in layer.parameters())
            # (host-resident shards: unset means resharded, their casts come from host memory anyway)
            self.keep_gathered = keeps_gathered_layers(arr.actor.fsdp_config, self.world, gathered * compute_dtype.itemsize,
                                                       None if offload else device.total_memory())
            # a lone rank that keeps its layers gathered has nothing to free layer by layer: one group for the whole
            # model, so each micro-batch runs FSDP2's hooks once instead of once per layer (the same weights bit for
            # bit; on the 2-core CPU a host-bound update of 24 narrow layers, 32 micro-batches: 2.37-2.77 s against
            # 3.30-3.63 s per layer, plain torch 2.16-2.58 s; not yet measured on a GPU)
            fsdp.shard_model(self.model, compute_dtype, offload, mesh, not self.keep_gathered,
                             per_layer=not (self.keep_gathered and self.world == 1))
            if self.ref_model is not None:   # forward only: its layers are freed after each forward
                fsdp.shard_model(self.ref_model, compute_dtype, offload, mesh)
        self.compiled = arr.actor.use_torch_compile and all(
            compile_decoder_layers(m, device) for m in (self.model, self.ref_model) if m is not None)
        optim = arr.actor.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]   # LoRA: the adapters only
        self.optimizer = torch.optim.AdamW(trainable, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        self.warmup_steps = warmup_steps(optim, total_optimizer_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_optimizer_steps))
        self.temperature = arr.rollout.temperature
        self.critic: Optional[Any] = None   # the value model (algorithm.adv_estimator=gae), value_model.ValueModel
        if uses_critic(cfg):
            from fully_async.train.backends.value_model import ValueModel

            self.critic = ValueModel(cfg, device, total_optimizer_steps, self.fsdp, compute_dtype, self.sp)
        self.reward_model: Optional[Any] = None   # reward_model.enable: reward_model.RewardModel
        if cfg.reward_model.enable:
            from fully_async.train.backends.reward_model import RewardModel

            self.reward_model = RewardModel(cfg, device, self.fsdp, compute_dtype, self.sp)
        self.rng = random.Random(cfg.trainer.seed)   # the PPO update's shuffle
        self.num_bad_steps = 0          # total optimizer steps skipped for a non-finite loss/grad (ppo_update counts)
        self.consecutive_bad_steps = 0  # reset by every good optimizer step

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor", num_micro: Optional[int] = None
                          ) -> torch.Tensor:
        """(B, L) log-probs of `batch` under the actor or the frozen reference, micro-batched.

        `num_micro` forces that many forward passes (sharded ranks must run the same number)."""
        def logp(model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
            return token_log_probs(model, mb, self.temperature, packed=self.packed, fused=self.fused,
                                   compiled=self.chunk_compiled)[0]
        return self._token_pass(batch, which, num_micro, logp)

    @torch.no_grad()
    def compute_sum_pi_squared(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B, L) sum_v pi_v^2 per position under the actor (actor.calculate_sum_pi_squared), in the old-policy
        pass's micro-batches."""
        return self._token_pass(batch, "actor", num_micro, lambda model, mb: token_sum_pi_squared(
            model, mb, self.temperature, packed=self.packed, fused=self.fused))

    def _token_pass(self, batch: TrainBatch, which: str, num_micro: Optional[int],
                    fn: Callable[[torch.nn.Module, TrainBatch], torch.Tensor]) -> torch.Tensor:
        """(B, L) float32 of `fn(model, micro_batch)` over `batch` under the actor or the reference, in the
        rollout's (or ref's) log-prob micro-batches, the model in eval mode meanwhile."""
        arr = self.cfg.actor_rollout_ref
        sub = arr.rollout if which == "actor" else arr.ref
        model = self.model if which == "actor" else self.ref_model
        if model is None:
            raise RuntimeError("reference log-probs requested but no reference model was built")
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        splits = micro_batches(batch, sub.log_prob_micro_batch_size_per_gpu, sub.log_prob_use_dynamic_bsz,
                               sub.log_prob_max_token_len_per_gpu * self.sp, self.packed)
        for idx, dummy in pad_micro_batches(splits, num_micro):
            values = fn(model, batch.select(idx).to(self.torch_device, pack=self.packed))
            if not dummy:
                out[idx, :values.shape[1]] = values.float().cpu()
        model.train(was_training)
        return out

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B, L) values of `batch` under the critic (0 off the response), in critic.forward_* micro-batches;
        `num_micro` forces that many passes (sharded ranks must run the same number)."""
        critic = self._critic()
        c = critic.settings
        splits = micro_batches(batch, c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz,
                               c.forward_max_token_len_per_gpu * self.sp, self.packed)
        return critic.values(batch, pad_micro_batches(splits, num_micro), self.torch_device, self.packed)

    def compute_rm_scores(self, batch: TrainBatch, num_micro: Optional[int] = None) -> torch.Tensor:
        """(B,) reward-model scores of `batch` (the reward model's own tokens, one row per response), in
        reward_model.* micro-batches; `num_micro` forces that many passes (sharded ranks run the same number)."""
        if self.reward_model is None:
            raise RuntimeError("reward-model scores requested but no reward model was built (reward_model.enable)")
        rm = self.reward_model.settings
        splits = micro_batches(batch, rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz,
                               rm.forward_max_token_len_per_gpu * self.sp, self.packed)
        return self.reward_model.scores(batch, pad_micro_batches(splits, num_micro), self.torch_device, self.packed)

    def _critic(self) -> Any:
        if self.critic is None:
            raise RuntimeError("values requested but no critic was built (algorithm.adv_estimator=gae or "
                               "critic.enable=true builds one)")
        return self.critic

    def _trainee(self, which: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, float]:
        """(model, optimizer, LR schedule, grad clip) of the actor or the critic."""
        if which == "actor":
            return self.model, self.optimizer, self.scheduler, self.actor_cfg.grad_clip
        if which == "critic":
            critic = self._critic()
            return critic.model, critic.optimizer, critic.scheduler, critic.grad_clip
        raise ValueError(f"which={which!r} is not 'actor' or 'critic'")

    def _forward(self, which: str, mb: TrainBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The update's per-token outputs of one micro-batch: the actor's log-probs and entropy, or the
        critic's values (and no entropy)."""
        if which == "critic":
            from fully_async.train.backends.value_model import token_values

            return token_values(self._critic().model, mb, self.packed), None
        return token_log_probs(self.model, mb, self.temperature, with_entropy=True, packed=self.packed,
                               fused=self.fused, compiled=self.chunk_compiled)

    # ------------------------------------------------------------------ update (driven by train/ppo_update.py)
    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        """Forward + backward of `mini.loss` over this rank's micro-batches of `mini.model` (the actor or the
        critic), gradients accumulating from zero.

        Each micro-batch's loss is already normalised to the whole mini-batch, so the sum over micro-batches
        (and over ranks) is the mini-batch loss; under FSDP2 it is multiplied by the world size to undo the
        data-parallel gradient averaging (with Ulysses by the whole world: ulysses.py).  Returns the additive metrics
        of the real micro-batches (none from a sequence-parallel group's other ranks: they are the first's)."""
        micro, real = mini.shard(self.dp_rank)
        sums: dict[str, torch.Tensor] = {}
        model, optimizer = self._trainee(mini.model)[:2]
        optimizer.zero_grad(set_to_none=True)
        lone = self._lone_rank(model)
        keep_gathered = lone and mini.model == "actor" and self.keep_gathered
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            if lone and (i == 0 or last):   # set where it changes: each call walks every module of the model
                model.set_requires_gradient_sync(last)
                if keep_gathered:
                    model.set_reshard_after_backward(last)
            mb = mb.to(self.torch_device, non_blocking=True, pack=self.packed)
            res = mini.loss(mb, *self._forward(mini.model, mb))
            # backward even for a non-finite loss or a dummy: every rank must run the same collectives; the
            # update then skips the step on all ranks together
            (res.loss * float(self.world)).backward()
            if i >= real or not self.reports:   # a dummy (zero mask): every metric of it is 0
                continue
            # summed where they are, in float64 (metric_floats' arithmetic), read once after the loop: reading each
            # micro-batch's would wait for its backward before the next forward could be queued
            for key, value in res.metric_doubles().items():
                sums[key] = sums[key] + value if key in sums else value
        return {key: float(value) for key, value in sums.items()}

    def _lone_rank(self, model: torch.nn.Module) -> bool:
        """`model` is sharded by FSDP2 over this one rank (verl's `fsdp` on one trainer device in bf16: float32 master
        weights, bf16 compute).  Its micro-batches then accumulate their gradients unsharded in float32 (FSDP2's
        no-sync accumulation in the reduce dtype) and reduce once, after the mini-batch's last: the same float32
        sums as a reduce after each (bit for bit: tests/unit/train/test_one_device_bf16.py), without each
        micro-batch's copies into and out of a reduce-scatter over one rank.  Where the layers stay gathered
        (keeps_gathered_layers: by default on one rank) the bf16 weights also stay from the first micro-batch to the
        last, so no later micro-batch gathers (casts) them again.  Why: a torch profile of the seed-003 step on 1x
        H200 (one-rank fsdp2, 0.5B shape) shows ~1,300 small copy kernels a micro-batch (~620 device-to-device, ~630
        bf16 writes) that the plain-torch update does not launch.  Measured there, interleaved in one call: the
        reduce once a mini-batch alone did not move the update (3.04-3.15 s against 3.08-3.09 s); with the layers
        kept gathered it took 2.84-2.93 s (docs/measurements/one_rank_fsdp_h200/).  Not with offload_policy, whose
        shards and gradients stay in host memory."""
        from torch.distributed.fsdp import FSDPModule

        # host-resident shards (offload_policy) keep the gradients off the device: no unsharded accumulation there
        return self.fsdp and self.world == 1 and not self.host_resident and isinstance(model, FSDPModule)

    def optimizer_step(self, finite: bool, which: str = "actor") -> StepResult:
        """Clip, check the global grad norm, step the optimizer and the LR schedule of the actor or the critic;
        or drop the gradients."""
        model, optimizer, scheduler, grad_clip = self._trainee(which)
        grad_norm = None
        if finite:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
                norm = norm.full_tensor()
            grad_norm = float(norm) if torch.isfinite(norm) else None
        if grad_norm is None:
            optimizer.zero_grad(set_to_none=True)
            return StepResult(None, scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        if which == "critic":   # its gradients would otherwise stay allocated through the actor's update
            optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm, scheduler.get_last_lr()[0])

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        """CPU copies of every parameter (tied weights once), as the rollout engine names them.

        Under FSDP2 every rank must call (parameters are all-gathered); only rank 0 gets the dict."""
        return {name: t.to("cpu", copy=True) for name, t in self.iter_full_parameters() if self.rank == 0}

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and full (unsharded) shapes, in the order iter_full_parameters yields them (LoRA: the merged
        model's)."""
        return [(name, tuple(p.shape)) for name, p in self.model.named_parameters()
                if not name.endswith((".lora_A", ".lora_B"))]

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        """Rank 0 hands the full-parameter iterator to `consumer`; other ranks only join the gathers."""
        params = self.iter_full_parameters()
        if self.rank == 0 and consumer is not None:
            return consumer(params)
        for _ in params:
            pass
        return 0

    def iter_full_parameters(self):
        """(name, full tensor on the device) per parameter; all ranks iterate under FSDP2.  LoRA: the merged model's
        parameters (lora.merged_parameters)."""
        raw = self._raw_full_parameters()
        return lora.merged_parameters(self.model, raw) if self.lora is not None else raw

    def _raw_full_parameters(self):
        if self.fsdp:
            return fsdp.full_parameters(self.model)
        return ((name, p.detach()) for name, p in self.model.named_parameters())

    # ------------------------------------------------------------------ checkpoint
    def _extra_state(self, with_optimizer: bool) -> dict:
        extra = {"scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                 "py_rng": self.rng.getstate(), "num_bad_steps": self.num_bad_steps}
        if with_optimizer:
            extra["optimizer"] = self.optimizer.state_dict()
        return extra

    def save(self, path: str) -> None:
        """actor/ as a Hugging Face folder (directly exportable) + optimizer/scheduler/RNG states; with a critic
        also its weights, optimizer and LR schedule (save_critic).

        FSDP2: every rank writes its shards (torch.distributed.checkpoint) and its own RNG file;
        rank 0 also writes the gathered Hugging Face folder.  LoRA: actor/ is the merged model and actor/lora_adapter/
        the adapter (peft's format), which is what a resume loads onto the base."""
        if self.critic is not None:
            self.save_critic(path)
        if not self.fsdp and self.lora is None:
            self.model.save_pretrained(os.path.join(path, "actor"), safe_serialization=True)
            safe_write.torch_save(self._extra_state(True), os.path.join(path, "actor_optim.pt"))
            return
        full = self._save_merged_and_adapter(path) if self.lora is not None else self.named_parameters_for_sync()
        if not self.fsdp:   # LoRA on one device: the adapter's optimizer state with the rest
            safe_write.torch_save(self._extra_state(True), os.path.join(path, "actor_optim.pt"))
            return
        fsdp.save_sharded(self.model, self.optimizer, path)
        safe_write.torch_save(self._extra_state(False), os.path.join(path, f"actor_extra_rank{self.rank}.pt"))
        if self.rank == 0 and self.lora is None:
            self._save_hf_folder(path, full)

    def _save_hf_folder(self, path: str, full: dict[str, torch.Tensor]) -> None:
        """actor/: a Hugging Face folder of the (gathered, merged) full parameters."""
        from safetensors.torch import save_file

        actor = os.path.join(path, "actor")
        os.makedirs(actor, exist_ok=True)
        self.model.config.save_pretrained(actor)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(actor, "model.safetensors"))

    def _save_merged_and_adapter(self, path: str) -> dict[str, torch.Tensor]:
        """LoRA: actor/ (the merged model, a plain Hugging Face folder) and actor/lora_adapter/ (peft's format) from
        one pass over the full parameters (every rank iterates under FSDP2; rank 0 writes); the merged parameters."""
        adapter: list[tuple[str, torch.Tensor]] = []

        def tap(named):
            for name, tensor in named:
                if name.endswith((".lora_A", ".lora_B")) and self.rank == 0:
                    adapter.append((name, tensor.cpu()))
                yield name, tensor

        full = {name: t.to("cpu", copy=True) for name, t in lora.merged_parameters(self.model, tap(
            self._raw_full_parameters())) if self.rank == 0}
        if self.rank == 0:
            self._save_hf_folder(path, full)
            lora.save_adapter(os.path.join(path, "actor", "lora_adapter"), lora.adapter_state(adapter), *self.lora[:2],
                              self.lora_targets, self.cfg.actor_rollout_ref.model.path)
        return full

    def save_critic(self, path: str) -> None:
        """critic/ (a Hugging Face folder of the value model, one device) and critic_optim.pt (optimizer and LR
        schedule); FSDP2: every rank writes its shards to fsdp_critic/ and its schedule to
        critic_extra_rank<r>.pt."""
        critic = self._critic()
        if not self.fsdp:
            critic.model.save_pretrained(os.path.join(path, "critic"), safe_serialization=True)
            safe_write.torch_save({"optimizer": critic.optimizer.state_dict(), **critic.state()},
                       os.path.join(path, "critic_optim.pt"))
            return
        fsdp.save_sharded(critic.model, critic.optimizer, path, "fsdp_critic")
        safe_write.torch_save(critic.state(), os.path.join(path, f"critic_extra_rank{self.rank}.pt"))

    def load_critic(self, path: str) -> None:
        """What save_critic wrote; a checkpoint without a critic is an error naming the folder."""
        critic = self._critic()
        if not os.path.isdir(os.path.join(path, "fsdp_critic" if self.fsdp else "critic")):
            raise FileNotFoundError(f"checkpoint {path} has no critic (it was saved by a run without one): resume "
                                    "with the same algorithm.adv_estimator / critic.enable, or start afresh")
        if self.fsdp:
            fsdp.load_sharded(critic.model, critic.optimizer, path, "fsdp_critic")
            extra = torch.load(os.path.join(path, f"critic_extra_rank{self.rank}.pt"), weights_only=True)
        else:
            load_hf_weights(critic.model, os.path.join(path, "critic"))
            extra = torch.load(os.path.join(path, "critic_optim.pt"), weights_only=True)
            critic.optimizer.load_state_dict(extra["optimizer"])
        critic.scheduler.load_state_dict(extra["scheduler"])

    def _load_extra(self, extra: dict) -> None:
        if "optimizer" in extra:
            self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        self.rng.setstate(extra["py_rng"])
        self.num_bad_steps = extra["num_bad_steps"]

    def load(self, path: str) -> None:
        if self.critic is not None:
            self.load_critic(path)
        if self.fsdp:
            fsdp.load_sharded(self.model, self.optimizer, path)
            self._load_extra(torch.load(os.path.join(path, f"actor_extra_rank{self.rank}.pt"), weights_only=True))
            return
        if self.lora is not None:   # the base is the model's own; the checkpoint's adapter goes on it
            lora.load_adapter(self.model, os.path.join(path, "actor", "lora_adapter"))
        else:
            load_hf_weights(self.model, os.path.join(path, "actor"))
        self._load_extra(torch.load(os.path.join(path, "actor_optim.pt"), weights_only=True))

    def offload(self) -> None:
        """Move params (and grads, optimizer state, the reference model) to pinned host buffers reused from one
        offload to the next (core/host_offload.py); no-op on cpu and for host-resident shards (offload_policy: as
        verl's, which then skips its phase offload; FSDP2 expects those shards on the host)."""
        if self.device.is_accelerator and not self.host_resident:
            if self._host is None:
                from fully_async.core.host_offload import HostOffload

                self._host = HostOffload()
            for m in self._models():
                self._host.module_to_host(m)
            for optimizer in self._optimizers():
                self._host.state_to_host(optimizer)
            self.device.synchronize()   # the copies are in the host buffers before the device memory goes back
            self.device.empty_cache()

    def onload(self) -> None:
        if self.device.is_accelerator and not self.host_resident:
            from fully_async.core.host_offload import HostOffload

            host = self._host or HostOffload()
            for m in self._models():
                host.module_to_device(m, self.torch_device)
            for optimizer in self._optimizers():
                host.state_to_device(optimizer, self.torch_device)

    def memory_parts(self) -> dict[str, int]:
        """Bytes this rank holds on its device: every model's weights (and buffers), the gradients, the optimizer
        states (device_memory/tenant.py; 0 each while offloaded)."""
        from fully_async.device_memory.tenant import held_bytes, optimizer_tensors

        models = self._models()
        return held_bytes({"weights": [t for m in models for t in (*m.parameters(), *m.buffers())],
                           "grads": [p.grad for m in models for p in m.parameters()],
                           "optimizer": [t for o in self._optimizers() for t in optimizer_tensors(o)]},
                          self.torch_device.type)

    def _models(self) -> list[torch.nn.Module]:
        """Every model this backend holds: the actor, the reference, the critic, the reward model (those built)."""
        critic = self.critic.model if self.critic is not None else None
        rm = self.reward_model.model if self.reward_model is not None else None
        return [m for m in (self.model, self.ref_model, critic, rm) if m is not None]

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])
