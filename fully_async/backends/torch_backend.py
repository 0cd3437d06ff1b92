"""Single-device torch training backend: log-probs, the PPO update, weights for sync (layer 2).

The update is written so that micro-batching never changes the numbers: each micro-batch's
loss is divided by the token (or sequence) count of its whole mini-batch, gradients accumulate,
and the optimizer steps once per mini-batch.  A non-finite loss or gradient norm skips that
optimizer step (the grads are dropped) and is reported in `actor/bad_steps`.
"""
from __future__ import annotations

import copy
import glob
import logging
import math
import os
import random
from typing import Any, Optional

import torch

from fully_async.algorithms.losses import PolicyLossInput, agg_loss, entropy_from_logits, kl_penalty, policy_loss
from fully_async.batch import TrainBatch, micro_batches
from fully_async.config import clip_bounds
from fully_async.device import Device, parse_dtype

logger = logging.getLogger(__name__)


def token_log_probs(model: torch.nn.Module, batch: TrainBatch, temperature: float,
                    with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, L) log p(input_ids[t] | <t) at logits / temperature (0 at t = 0), and optionally entropy."""
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    logits = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)          # (B, L-1, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp = torch.nn.functional.pad(logp, (1, 0))                                        # (B, L)
    ent = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0)) if with_entropy else None
    return logp, ent


class TorchBackend:
    def __init__(self, cfg: Any, device: Device, total_optimizer_steps: int):
        from transformers import AutoModelForCausalLM

        arr = cfg.actor_rollout_ref
        self.cfg = cfg
        self.actor_cfg = arr.actor
        self.device = device
        self.torch_device = device.torch_device()
        torch.manual_seed(cfg.trainer.seed)
        self.model = AutoModelForCausalLM.from_pretrained(
            arr.model.path, dtype=parse_dtype(arr.actor.dtype), trust_remote_code=arr.model.trust_remote_code,
        ).to(self.torch_device)
        if arr.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        need_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if need_ref else None
        optim = arr.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio *
                                                                               total_optimizer_steps)
        self.warmup_steps = warmup
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
        self.temperature = arr.rollout.temperature
        self.rng = random.Random(cfg.trainer.seed)
        self.num_bad_steps = 0          # total optimizer steps skipped for a non-finite loss/grad
        self.consecutive_bad_steps = 0  # reset by every good optimizer step

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        """(B, L) log-probs of `batch` under the actor or the frozen reference, micro-batched."""
        arr = self.cfg.actor_rollout_ref
        sub = arr.rollout if which == "actor" else arr.ref
        model = self.model if which == "actor" else self.ref_model
        if model is None:
            raise RuntimeError("reference log-probs requested but no reference model was built")
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for idx in micro_batches(batch, sub.log_prob_micro_batch_size_per_gpu, sub.log_prob_use_dynamic_bsz,
                                 sub.log_prob_max_token_len_per_gpu):
            mb = batch.select(idx).to(self.torch_device)
            logp, _ = token_log_probs(model, mb, self.temperature)
            out[idx, :logp.shape[1]] = logp.float().cpu()
        model.train(was_training)
        return out

    # ------------------------------------------------------------------ update
    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]:
        """PPO update over `batch` split into `num_mini_batches` optimizer steps, `ppo_epochs` times."""
        a = self.actor_cfg
        at = self.cfg.async_training
        clip_low, clip_high = clip_bounds(a)
        mini_size = math.ceil(len(batch) / num_mini_batches)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1

        for _ in range(a.ppo_epochs):
            order = list(range(len(batch)))
            if a.shuffle:
                self.rng.shuffle(order)
            for start in range(0, len(batch), mini_size):
                mini = batch.select(order[start:start + mini_size])
                mask = mini.response_mask
                denom = float(mask.sum()) if a.loss_agg_mode == "token-mean" else float((mask.sum(-1) > 0).sum())
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for idx in micro_batches(mini, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                         a.ppo_max_token_len_per_gpu):
                    mb = mini.select(idx).to(self.torch_device)
                    logp, ent = token_log_probs(self.model, mb, self.temperature, with_entropy=True)
                    out = policy_loss(PolicyLossInput(
                        logp=logp, old_logp=mb.old_log_probs, advantages=mb.advantages, mask=mb.response_mask,
                        clip_low=clip_low, clip_high=clip_high, clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode,
                        denom=denom, behav_logp=mb.rollout_log_probs if at.decoupled_ppo else None,
                        behav_cap=at.behav_imp_weight_cap))
                    loss = out.loss
                    entropy = agg_loss(ent, mb.response_mask, a.loss_agg_mode, denom)
                    if a.entropy_coeff != 0:
                        loss = loss - a.entropy_coeff * entropy
                    if a.use_kl_loss:
                        kl = agg_loss(kl_penalty(logp, mb.ref_log_probs, a.kl_loss_type), mb.response_mask,
                                      a.loss_agg_mode, denom)
                        loss = loss + a.kl_loss_coef * kl
                        add("actor/kl_loss", kl.item())
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    loss.backward()
                    share = len(idx) / len(mini)
                    add("actor/pg_loss", out.loss.item())
                    add("actor/entropy", entropy.item())
                    add("actor/pg_clipfrac", out.clipfrac.item() * share)
                    add("actor/pg_clipfrac_lower", out.clipfrac_lower.item() * share)
                    add("actor/ppo_kl", out.ppo_kl.item() * share)
                    if out.behav_weight_mean is not None:
                        add("actor/behav_imp_weight", out.behav_weight_mean.item() * share)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip) if finite else None
                if grad_norm is None or not torch.isfinite(grad_norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.num_bad_steps += 1
                    self.consecutive_bad_steps += 1
                    add("actor/bad_steps", 1.0)
                    logger.warning("non-finite loss or grad norm: optimizer step skipped (%d so far)",
                                   self.num_bad_steps)
                    continue
                self.optimizer.step()
                self.scheduler.step()
                self.consecutive_bad_steps = 0
                add("actor/grad_norm", grad_norm.item())
        # micro-batch terms are already scaled to their mini-batch, so sums / optimizer steps are
        # per-mini-batch means; grad_norm is averaged over the steps that were taken
        steps = a.ppo_epochs * math.ceil(len(batch) / mini_size)
        metrics = {k: v / steps for k, v in sums.items() if k not in ("actor/grad_norm", "actor/bad_steps")}
        if "actor/grad_norm" in sums:
            metrics["actor/grad_norm"] = sums["actor/grad_norm"] / counts["actor/grad_norm"]
        metrics["actor/bad_steps"] = sums.get("actor/bad_steps", 0.0)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        """CPU copies of every parameter (tied weights once), as the rollout engine names them."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}

    # ------------------------------------------------------------------ checkpoint
    def save(self, path: str) -> None:
        """actor/ as a Hugging Face folder (directly exportable) + optimizer/scheduler/RNG states."""
        self.model.save_pretrained(os.path.join(path, "actor"), safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state(), "py_rng": self.rng.getstate(),
                    "num_bad_steps": self.num_bad_steps}, os.path.join(path, "actor_optim.pt"))

    def load(self, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "actor", "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"checkpoint {path} has no actor/*.safetensors")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)}, "
                               f"unexpected {sorted(unexpected)}")
        extra = torch.load(os.path.join(path, "actor_optim.pt"), weights_only=False)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["torch_rng"])
        self.rng.setstate(extra["py_rng"])
        self.num_bad_steps = extra["num_bad_steps"]

    def offload(self) -> None:
        """Move params (and grads/optimizer state) to host memory; no-op on cpu."""
        if self.device.is_accelerator:
            self.model.to("cpu")
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to("cpu")
            self.device.empty_cache()

    def onload(self) -> None:
        if self.device.is_accelerator:
            self.model.to(self.torch_device)
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(self.torch_device)
