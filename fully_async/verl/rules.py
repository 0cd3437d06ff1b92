"""The table behind verl/compat.py (layer 1): one rule per verl key or key pattern outside our schema.

Each rule says what a verl key becomes here: mapped (honoured under our name), warned (no effect here, and why),
or refused (what to use instead); a warned or mapped rule may accept only some values (`allowed`) and refuse the
rest.  Rules are matched in order; `*` matches one key segment (`tau_*` the rest of one) and `**` any number of
them.  DEFAULT_DIFFERENCES lists our schema defaults that are not verl's, each with its reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fully_async.core.lora_targets import LORA_A_INITS

MAPPED, WARNED, REFUSED = "mapped", "warned", "refused"


@dataclass(frozen=True)
class Rule:
    pattern: str                      # verl key; '*' one segment (or the rest of one), '**' any segments
    status: str                       # mapped | warned | refused
    note: str                         # why (warned/refused) or what it maps to
    target: Optional[str] = None      # mapped: our key; '{0}', '{1}' are the wildcards' matches
    allowed: Optional[Callable[[Any], bool]] = None  # values outside it are refused (with `refusal`)
    allowed_doc: str = ""             # the accepted values, for the docs ("1", "null", "false")
    refusal: str = ""                 # what to use instead when the value is not allowed
    convert: Optional[Callable[[Any], Any]] = None   # mapped: value conversion
    null_unset: bool = False          # mapped: null means "not set" (warned, our key keeps its value)

    def regex(self) -> "re.Pattern[str]":
        parts = []
        for seg in self.pattern.split("."):
            if seg == "**":
                parts.append(r"(.+)")
            else:  # '*' alone is a whole segment, 'tau_*' the rest of one
                parts.append(r"([^.]*)".join(re.escape(p) for p in seg.split("*")))
        return re.compile(r"\.".join(parts) + r"\Z")


def _same(v: Any, x: Any) -> bool:
    if v is None or x is None:
        return v is x
    if isinstance(v, bool) or isinstance(x, bool):
        return isinstance(v, bool) and isinstance(x, bool) and v == x
    return v == x


def _is(*values: Any) -> Callable[[Any], bool]:
    """Accepts exactly these values (1 and 1.0 alike; true is not 1)."""
    return lambda v: any(_same(v, x) for x in values)


def _falsy(v: Any) -> bool:
    return v in (None, False, 0, "", [], {}) or v == {} or v == []


def _warn(pattern: str, note: str) -> Rule:
    return Rule(pattern, WARNED, note)


def _warn_if(pattern: str, allowed: Callable[[Any], bool], allowed_doc: str, note: str, refusal: str) -> Rule:
    return Rule(pattern, WARNED, note, allowed=allowed, allowed_doc=allowed_doc, refusal=refusal)


def _map(pattern: str, target: str, note: str = "", **kw: Any) -> Rule:
    return Rule(pattern, MAPPED, note or f"honoured as {target}", target=target, **kw)


def _refuse(pattern: str, note: str) -> Rule:
    return Rule(pattern, REFUSED, note)


CRITIC_FOLLOWS = ("the critic is built by the actor's backend (train/backends/value_model.py, megatron_critic.py): the "
                  "actor's strategy, "
                  "sharding, dtype, offload and packing (actor_rollout_ref.actor.*, actor_rollout_ref.model.*)")
RM = ("the reward model is built and run by the trainer's backend (reward_model.enable, model.path, "
      "model.input_tokenizer, micro_batch_size_per_gpu, max_length, use_dynamic_bsz, forward_max_token_len_per_gpu)")
RM_SERVED = ("the reward model is scored by a forward pass of the trainer's backend, between generation and the "
             "update: the same scores (its output at the last token) that verl's reward loop serves from a vLLM "
             "server")
PROFILER = ("the roles' profiler sections are not read: global_profiler.tool (torch, npu) and global_profiler.steps "
            "profile the trainer's listed steps in its rank 0 with the device's own profiler, whatever each role's "
            "enable; trainer.timeline=true writes a Perfetto trace of every actor's phases")
GLOBAL_PROFILER = ("global_profiler.tool, steps and save_path are honoured (the trainer's listed steps, rank 0, the "
                   "device's own profiler); this key is not read")
TARGET = "verl's dataclass target; our sections are typed by fully_async/core/config.py"
REF_FOLLOWS = "the reference model lives in the trainer next to the actor and uses the actor's layout and dtype"
SP = ("the reference model and the critic run at actor_rollout_ref.actor.ulysses_sequence_parallel_size (one "
      "sequence-parallel layout per trainer: the numbers do not depend on it)")
ONE = (_is(1, None), "1")
MT_TEMPLATE = ("verl's SGLang-era option: the tool answers are tokenized with the model's chat template as verl's "
               "agent loop does (rollout/tools.py)")
MOE = "mixture-of-experts parallelism is not implemented (the megatron backend trains dense Qwen2/Llama)"
DENSE_ONLY = ("the megatron backend trains dense Qwen2/Llama models (an MoE model is refused when it loads), which "
              "have no expert layers for expert parallelism to split")
# our list-valued keys that verl also takes as one string (`trainer.logger=console`)
SCALAR_AS_LIST = ("trainer.logger",)


# critic.* keys outside our schema (core/config.py CriticConfig holds the honoured ones)
CRITIC_RULES: list[Rule] = [
    _map("critic.optim.clip_grad", "critic.grad_clip", "verl's optimizer-level name of critic.grad_clip"),
    _map("critic.optim.lr_decay_style", "critic.optim.lr_scheduler_type", "verl's megatron name of "
         "lr_scheduler_type", allowed=_is("constant", "cosine"), allowed_doc="constant|cosine",
         refusal="only constant and cosine decay are implemented (critic.optim.lr_scheduler_type)"),
    _map("critic.optim.warmup_style", "critic.optim.lr_scheduler_type", "verl's deprecated name of "
         "lr_scheduler_type (null: unset)", allowed=_is(None, "constant", "cosine"),
         allowed_doc="null|constant|cosine", refusal="only constant and cosine are implemented", null_unset=True),
    _warn_if("critic.optim.optimizer", _is("AdamW", "adamw", "adam"), "AdamW", "the critic's optimizer is torch's "
             "AdamW", "only AdamW is implemented"),
    _warn_if("critic.optim.optimizer_impl", _is("torch.optim"), "torch.optim", "the critic's optimizer is "
             "torch.optim.AdamW", "only torch.optim's AdamW is implemented"),
    _warn_if("critic.optim.lr_warmup_init", _is(0, 0.0), "0.0", "the warm-up starts from lr 0, as verl's default",
             "warm-up from a non-zero lr is not implemented"),
    _warn_if("critic.optim.min_lr", _is(0, 0.0), "0.0", "the floor is min_lr_ratio (cosine)",
             "use critic.optim.min_lr_ratio (a fraction of lr)"),
    _warn_if("critic.optim.weight_decay_incr_style", _is("constant"), "constant", "a constant weight decay",
             "only a constant weight decay is implemented"),
    _warn("critic.optim.**", "a megatron optimizer option: the critic's AdamW takes critic.optim.{lr, betas, "
          "weight_decay, lr_warmup_steps(_ratio), lr_scheduler_type, min_lr_ratio, num_cycles}"),
    _warn_if("critic.ppo_micro_batch_size", _is(None), "null", "deprecated global micro batch",
             "use critic.ppo_micro_batch_size_per_gpu"),
    _warn_if("critic.forward_micro_batch_size", _is(None), "null", "deprecated global micro batch",
             "use critic.forward_micro_batch_size_per_gpu"),
    _warn("critic.rollout_n", "actor_rollout_ref.rollout.n is the responses per prompt"),
    _warn("critic.data_loader_seed", "mini-batches are cut from the trainer's shuffle RNG (trainer.seed), as the "
          "actor's"),
    _warn("critic.checkpoint.**", "a checkpoint always holds the critic's weights, optimizer and LR schedule, "
          "next to the actor's"),
    _warn_if("critic.load_weight", _is(True), "true", "the critic's trunk is critic.model.path (or the actor's "
             "model)", "a randomly initialised critic trunk is not implemented"),
    _warn("critic.model.tokenizer_path", "the actor's tokenizer prepares every batch the critic sees"),
    _warn_if("critic.model.external_lib", _is(None), "null", "the critic is built in the actor's processes, which "
             "import actor_rollout_ref.model.external_lib", "set actor_rollout_ref.model.external_lib: every "
             "process of the run imports it"),
    _warn_if("critic.model.lora_rank", _is(0), "0", "no LoRA", "LoRA is not implemented"),
    _warn_if("critic.model.lora.rank", _is(0), "0", "no LoRA", "LoRA is not implemented"),
    _warn("critic.model.lora.**", "LoRA is not implemented (lora_rank=0)"),
    _warn("critic.model.lora_*", "LoRA is not implemented (lora_rank=0)"),
    _warn("critic.model.target_modules", "LoRA is not implemented (lora_rank=0)"),
    _warn_if("critic.model.tiled_mlp.enabled", _is(False), "false", "no tiled MLP",
             "the tiled MLP is not implemented"),
    _warn("critic.model.tiled_mlp.**", "the tiled MLP is not implemented"),
    _warn_if("critic.model.enable_activation_offload", _is(False), "false", "no activation offload",
             "activation offload is not implemented"),
    _warn("critic.model.use_shm", "models are read from a local folder"),
    _warn("critic.model.use_remove_padding", CRITIC_FOLLOWS),
    _warn("critic.model.fsdp_config.**", CRITIC_FOLLOWS),
    _warn("critic.model.override_config.model_config", "verl's megatron critic override; HF config fields go "
          "directly under critic.model.override_config"),
    _warn("critic.model.override_config.moe_config.**", MOE),
    _warn("critic.megatron.**", "the critic is built by the actor's backend in the actor's layout and dtype "
          "(actor_rollout_ref.actor.megatron.*, actor_rollout_ref.actor.dtype; train/backends/megatron_critic.py)"),
]


RULES: list[Rule] = [
    # ---------------------------------------------------------------- everywhere
    _warn("**._target_", TARGET),
    _map("actor_rollout_ref.actor.profiler.tool_config.torch.contents", "global_profiler.contents",
         "what the trainer's profiled steps record (global_profiler.tool=torch)"),
    _map("actor_rollout_ref.actor.profiler.tool_config.npu.contents", "global_profiler.contents",
         "what the trainer's profiled steps record (global_profiler.tool=npu)"),
    _warn("**.profiler.**", PROFILER),
    _warn("global_profiler.**", GLOBAL_PROFILER),
    _warn("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", "verl's engine-worker copy: the size "
          "is actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    _warn("**.ulysses_sequence_parallel_size", SP),
    _warn("**.use_torch_compile", "compilation is set once, by actor_rollout_ref.actor.use_torch_compile (each "
          "decoder layer of the actor and of the reference model, torch/fsdp2 on CUDA); the embedded engine's "
          "decode follows actor_rollout_ref.rollout.fused_decode / enforce_eager"),
    _warn("**.nccl_timeout", "collectives use the backend's default timeout; trainer.progress_timeout_s bounds a "
          "stalled run"),
    # ---------------------------------------------------------------- actor
    _map("actor_rollout_ref.actor.optim.lr_decay_style", "actor_rollout_ref.actor.optim.lr_scheduler_type",
         "verl's megatron name of lr_scheduler_type", allowed=_is("constant", "cosine"), allowed_doc="constant|cosine",
         refusal="only constant and cosine decay are implemented (actor_rollout_ref.actor.optim.lr_scheduler_type)"),
    _map("actor_rollout_ref.actor.optim.warmup_style", "actor_rollout_ref.actor.optim.lr_scheduler_type",
         "verl's deprecated name of lr_scheduler_type (null: unset)", allowed=_is(None, "constant", "cosine"),
         allowed_doc="null|constant|cosine", refusal="only constant and cosine are implemented", null_unset=True),
    _map("actor_rollout_ref.actor.optim.clip_grad", "actor_rollout_ref.actor.grad_clip",
         "verl's optimizer-level name of actor.grad_clip"),
    _warn("actor_rollout_ref.actor.optim.lr_decay_steps", "the decay runs over the run's optimizer steps "
          "(optim.total_training_steps, derived from the data), as verl's FSDP actor does; megatron's separate "
          "decay length is not used (a constant schedule never reads it)"),
    _warn_if("actor_rollout_ref.actor.optim.lr_warmup_init", _is(0, 0.0), "0.0",
             "the warm-up starts from lr 0, as verl's default", "warm-up from a non-zero lr is not implemented"),
    _warn_if("actor_rollout_ref.actor.optim.min_lr", _is(0, 0.0), "0.0", "the floor is min_lr_ratio (cosine)",
             "use actor_rollout_ref.actor.optim.min_lr_ratio (a fraction of lr)"),
    _warn("actor_rollout_ref.actor.optim.lr_wsd_decay_steps", "the WSD schedule is not implemented "
          "(lr_decay_style=wsd is refused)"),
    _warn("actor_rollout_ref.actor.optim.lr_wsd_decay_style", "the WSD schedule is not implemented"),
    _warn_if("actor_rollout_ref.actor.optim.optimizer", _is("AdamW", "adamw", "adam"), "AdamW",
             "the optimizer is torch's AdamW (megatron: its distributed Adam)", "only AdamW is implemented"),
    _warn_if("actor_rollout_ref.actor.optim.optimizer_impl", _is("torch.optim"), "torch.optim",
             "the optimizer is torch.optim.AdamW", "only torch.optim's AdamW is implemented"),
    _warn("actor_rollout_ref.actor.optim.override_optimizer_config", "extra megatron optimizer options "
          "(CPU optimizer offload and the like) are not passed to the optimizer"),
    _warn("actor_rollout_ref.actor.optim.override_optimizer_config.**", "extra megatron optimizer options "
          "(CPU optimizer offload and the like) are not passed to the optimizer"),
    _warn("actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler",
          "the LR scheduler's state is always saved and restored with the checkpoint"),
    _warn_if("actor_rollout_ref.actor.optim.weight_decay_incr_style", _is("constant"), "constant",
             "weight decay is constant", "only a constant weight decay is implemented"),
    _map("actor_rollout_ref.actor.fsdp_config.dtype", "actor_rollout_ref.actor.dtype",
         "verl's FSDP compute dtype is our actor.dtype (default float32, verl's bf16); in bf16/fp16 verl's `fsdp` "
         "keeps float32 master weights and AdamW states on any number of trainer devices, one included (a one-rank "
         "fsdp2), as verl does; only an explicit `actor.strategy=torch` trains the parameters in the dtype itself "
         "(warned at start)",
         convert=lambda v: {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(v, v)),
    _map("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", "actor_rollout_ref.actor.dtype",
         "verl's FSDP1 mixed-precision compute dtype is our actor.dtype (float32 master weights)",
         convert=lambda v: {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(v, v)),
    _warn("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype", "FSDP2 reduces gradients in float32 "
          "(more precise than a bf16 reduction)"),
    _warn("actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype", "buffers (the rotary tables) stay in "
          "float32"),
    _warn("actor_rollout_ref.actor.fsdp_config.model_dtype", "FSDP2 keeps float32 master weights and computes "
          "in actor_rollout_ref.actor.dtype"),
    _warn("actor_rollout_ref.actor.fsdp_config.strategy", "set actor_rollout_ref.actor.strategy (fsdp maps to "
          "fsdp2, or to plain torch on one trainer device in float32)"),
    _warn("actor_rollout_ref.actor.fsdp_config.*", "an FSDP1 wrapping/prefetch/determinism knob: FSDP2 here "
          "wraps each decoder layer (fsdp_config.reshard_after_forward and fsdp_size are honoured)"),
    _warn("actor_rollout_ref.actor.fsdp_config.wrap_policy.*", "FSDP2 here wraps each decoder layer"),
    _warn("actor_rollout_ref.actor.megatron.use_mbridge", "HF weights are converted to megatron-core by "
          "fully_async/train/backends/hf_megatron.py (no mbridge needed)"),
    _warn("actor_rollout_ref.actor.megatron.vanilla_mbridge", "no mbridge is used"),
    _warn_if("actor_rollout_ref.actor.megatron.use_dist_checkpointing", _is(False), "false",
             "checkpoints are Hugging Face folders", "checkpoints are Hugging Face folders "
             "(trainer.default_local_dir); megatron dist checkpoints are not read or written"),
    _warn("actor_rollout_ref.actor.megatron.dist_checkpointing_*", "megatron dist checkpoints are not used"),
    _map("actor_rollout_ref.actor.megatron.param_offload", "actor_rollout_ref.actor.fsdp_config.param_offload",
         "one offload switch for every strategy: params and grads to host while sync mode's engine generates"),
    _map("actor_rollout_ref.actor.megatron.optimizer_offload",
         "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "one offload switch for every strategy"),
    _warn("actor_rollout_ref.actor.megatron.grad_offload", "grads move with the params "
          "(actor_rollout_ref.actor.megatron.param_offload)"),
    _warn("actor_rollout_ref.actor.megatron.override_transformer_config.moe_*", DENSE_ONLY + " (our backend "
          "keeps megatron's alltoall dispatcher, which its variable-length pipeline needs)"),
    _warn("actor_rollout_ref.actor.megatron.expert_model_parallel_size", DENSE_ONLY),
    _warn("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size", DENSE_ONLY),
    _map("actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.actor.dtype",
         "verl's megatron compute dtype is our actor.dtype"),
    _warn("actor_rollout_ref.actor.megatron.seed", "trainer.seed seeds every backend"),
    _warn("actor_rollout_ref.actor.megatron.forward_only", "set by verl internally for the reference model"),
    _warn("actor_rollout_ref.actor.megatron.use_remove_padding", "strategy=megatron trains right-padded rows "
          "(the same loss; packed THD attention needs Transformer Engine)"),
    _warn("actor_rollout_ref.actor.megatron.override_ddp_config", "megatron's DDP config is built from "
          "use_distributed_optimizer; extra fields are not passed"),
    _warn("actor_rollout_ref.actor.megatron.override_ddp_config.**", "megatron's DDP config is built from "
          "use_distributed_optimizer; extra fields are not passed"),
    _warn("actor_rollout_ref.actor.megatron.override_mcore_model_config", "the GPTModel is built from the HF "
          "config (override it with actor_rollout_ref.model.override_config)"),
    _warn("actor_rollout_ref.actor.megatron.override_mcore_model_config.**", "the GPTModel is built from the HF "
          "config (override it with actor_rollout_ref.model.override_config)"),
    _map("actor_rollout_ref.actor.use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels"),
    _map("actor_rollout_ref.actor.use_remove_padding", "actor_rollout_ref.model.use_remove_padding"),
    _map("actor_rollout_ref.actor.use_rollout_log_probs", "async_training.use_rollout_log_probs"),
    _warn("actor_rollout_ref.actor.rollout_n", "derived from actor_rollout_ref.rollout.n"),
    _warn("actor_rollout_ref.actor.calculate_entropy", "the entropy is always computed (actor/entropy)"),
    _warn("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "sum_pi_squared is computed without gradients, "
          "chunk by chunk (nothing to checkpoint)"),
    _warn("actor_rollout_ref.actor.checkpoint.*", "a checkpoint always holds the model, the optimizer and the "
          "extra state (scheduler, RNG, data position), written synchronously"),
    _warn("actor_rollout_ref.actor.data_loader_seed", "data.seed seeds the prompt order"),
    _warn("actor_rollout_ref.actor.entropy_checkpointing", "the chunked log-prob/entropy recomputes per chunk "
          "anyway"),
    _warn("actor_rollout_ref.actor.entropy_from_logits_with_chunking", "the log-prob/entropy is always chunked"),
    _warn("actor_rollout_ref.actor.freeze_vision_tower", "text-only models"),
    _warn_if("actor_rollout_ref.actor.load_weight", _is(True), "true", "the actor always loads model.path",
             "the actor always loads actor_rollout_ref.model.path"),
    _warn_if("actor_rollout_ref.actor.ppo_micro_batch_size", _is(None), "null", "deprecated global micro batch",
             "use actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    _warn("actor_rollout_ref.actor.router_replay.**", MOE),
    _warn_if("actor_rollout_ref.actor.use_prefix_grouper", _is(False), "false", "no shared-prefix grouping",
             "shared-prefix grouping is not implemented; use false"),
    _warn("actor_rollout_ref.checkpoint_engine", "weights move by actor_rollout_ref.rollout.weight_sync"),
    _warn("actor_rollout_ref.hybrid_engine", "async mode puts rollout and trainer on separate devices; "
          "mode=sync colocates them on every trainer device anyway"),
    # ---------------------------------------------------------------- model
    _map("actor_rollout_ref.model.override_config.model_config.**", "actor_rollout_ref.model.override_config.{0}",
         "verl's model_config sub-dict: Hugging Face config fields, our override_config"),
    _warn("actor_rollout_ref.model.override_config.model_config", "its fields are Hugging Face config overrides: "
          "set them as actor_rollout_ref.model.override_config.<field>"),
    _warn("actor_rollout_ref.model.override_config.moe_config.**", MOE),
    _warn_if("actor_rollout_ref.model.enable_activation_offload", _is(False), "false", "no activation offload",
             "activation offload is not implemented; use enable_gradient_checkpointing"),
    _warn_if("actor_rollout_ref.model.hf_config_path", _is(None), "null", "the config is model.path's",
             "put the config in actor_rollout_ref.model.path"),
    # verl's megatron LoRA section (model.lora.*, megatron-bridge's fused LoRA: train/backends/megatron_lora.py)
    _map("actor_rollout_ref.model.lora.rank", "actor_rollout_ref.model.lora_rank", "verl's megatron LoRA rank"),
    _map("actor_rollout_ref.model.lora.alpha", "actor_rollout_ref.model.lora_alpha", "verl's megatron LoRA alpha"),
    _map("actor_rollout_ref.model.lora.adapter_path", "actor_rollout_ref.model.lora_adapter_path",
         "verl's megatron LoRA adapter path", null_unset=True),
    _map("actor_rollout_ref.model.lora.target_modules", "actor_rollout_ref.model.target_modules",
         "verl's megatron LoRA targets (linear_qkv, linear_proj, linear_fc1, linear_fc2, or patterns)"),
    _map("actor_rollout_ref.model.lora.exclude_modules", "actor_rollout_ref.model.exclude_modules",
         "verl's megatron LoRA exclusions ([]: none)", convert=lambda v: None if _falsy(v) else v),
    _map("actor_rollout_ref.model.lora.lora_A_init_method", "actor_rollout_ref.model.lora_A_init_method",
         "verl's megatron lora_A init", allowed=_is(*LORA_A_INITS), allowed_doc="|".join(LORA_A_INITS),
         refusal="lora_A starts as xavier, kaiming or normal"),
    _warn_if("actor_rollout_ref.model.lora.lora_B_init_method", _is("zero"), "zero", "lora_B starts at zero",
             "lora_B starts at zero (the adapter starts as the base model)"),
    _warn_if("actor_rollout_ref.model.lora.type", _is("lora"), "lora", "megatron-bridge's fused LoRA (one adapter "
             "per megatron linear layer)", "only the fused `lora` type is implemented (not canonical_lora, dora, "
             "vlm_lora)"),
    _warn("actor_rollout_ref.model.lora.merge", "the engines always load the merged weights (W + alpha/r B A, "
          "verl's merge=true); merge=false serves the same adapter unmerged"),
    _warn_if("actor_rollout_ref.model.lora.dtype", _is(None), "null", "the adapters are in the model's dtype "
             "(float32 masters in the optimizer)", "the adapters use the model's dtype"),
    _warn_if("actor_rollout_ref.model.lora.dropout", _is(0, 0.0), "0.0", "no LoRA dropout",
             "LoRA dropout is not implemented"),
    _warn("actor_rollout_ref.model.lora.**", "a megatron LoRA option with no effect here (no dropout to position, "
          "no all-to-all experts, no vision tower to freeze)"),
    _warn_if("actor_rollout_ref.model.mtp.enable", _is(False), "false", "no multi-token prediction",
             "multi-token prediction is not implemented"),
    _warn("actor_rollout_ref.model.mtp.**", "multi-token prediction is not implemented (mtp.enable=false)"),
    _warn_if("actor_rollout_ref.model.tiled_mlp.enabled", _is(False), "false", "no tiled MLP",
             "the tiled MLP is not implemented"),
    _warn("actor_rollout_ref.model.tiled_mlp.**", "the tiled MLP is not implemented"),
    _warn("actor_rollout_ref.model.fused_kernel_options.**", "use_fused_kernels folds lm_head into the chunked "
          "log-prob in torch (no other backend)"),
    _warn_if("actor_rollout_ref.model.use_liger", _is(False), "false", "no Liger kernels",
             "Liger kernels are not implemented; use_fused_kernels=true saves the logits' memory"),
    _warn("actor_rollout_ref.model.use_shm", "models are read from a local folder"),
    # ---------------------------------------------------------------- ref
    _warn("actor_rollout_ref.ref.fsdp_config.**", REF_FOLLOWS + " (actor_rollout_ref.actor.fsdp_config.*)"),
    _warn("actor_rollout_ref.ref.megatron.**", REF_FOLLOWS + " (actor_rollout_ref.actor.megatron.*)"),
    _warn("actor_rollout_ref.ref.strategy", REF_FOLLOWS),
    _warn("actor_rollout_ref.ref.rollout_n", "derived from actor_rollout_ref.rollout.n"),
    _warn("actor_rollout_ref.ref.entropy_*", REF_FOLLOWS),
    _warn("actor_rollout_ref.ref.router_replay.**", MOE),
    _warn_if("actor_rollout_ref.ref.load_weight", _is(True), "true", "the reference model is model.path",
             "the reference model always loads actor_rollout_ref.model.path"),
    _warn_if("actor_rollout_ref.ref.log_prob_micro_batch_size", _is(None), "null", "deprecated global size",
             "use actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    # ---------------------------------------------------------------- rollout
    _warn("actor_rollout_ref.rollout.agent.**", "single-turn generation only (no agent loop)"),
    _map("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
         "actor_rollout_ref.rollout.update_weights_bucket_megabytes"),
    _warn("actor_rollout_ref.rollout.checkpoint_engine.**", "weights move by actor_rollout_ref.rollout.weight_sync "
          "(auto|object_store|collective)"),
    _warn_if("actor_rollout_ref.rollout.data_parallel_size", *ONE, "each engine replica is one data-parallel "
             "rank: replicas = rollout devices / tensor_model_parallel_size", "use 1 (more rollout devices give "
             "more replicas)"),
    _warn("actor_rollout_ref.rollout.disable_log_stats", "engine statistics go to fully_async/rollouter/* metrics"),
    _warn_if("actor_rollout_ref.rollout.do_sample", _is(True), "true", "training samples at "
             "rollout.temperature", "greedy training rollouts: set actor_rollout_ref.rollout.temperature=0"),
    _warn("actor_rollout_ref.rollout.enable_prefix_caching", "vLLM's own default (on) is used"),
    _warn("actor_rollout_ref.rollout.enable_rollout_routing_replay", MOE),
    _warn("actor_rollout_ref.rollout.engine_kwargs.**", "extra engine arguments are not passed; the named "
          "rollout keys (gpu_memory_utilization, max_num_seqs, enforce_eager, ...) are"),
    _warn_if("actor_rollout_ref.rollout.expert_parallel_size", *ONE, MOE, "use 1"),
    _map("actor_rollout_ref.rollout.ignore_eos", "benchmark.ignore_eos", "the engines ignore EOS (a benchmark "
         "setting)"),
    _warn("actor_rollout_ref.rollout.layer_name_map.**", "weights are loaded by name into the engine"),
    _warn("actor_rollout_ref.rollout.layered_summon", "the trainer gathers whole weights for the sync"),
    _warn_if("actor_rollout_ref.rollout.log_prob_micro_batch_size", _is(None), "null", "deprecated global size",
             "use actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    _warn("actor_rollout_ref.rollout.logprobs_mode", "the engines return log_softmax(logits / temperature) of each "
          "sampled token without the top-k/top-p mask (algorithms/sampling.py), in every engine"),
    _warn("actor_rollout_ref.rollout.mode", "the engines are always driven asynchronously (continuous batching); "
          "mode=sync|async at the top level picks the training loop"),
    _warn("actor_rollout_ref.rollout.mtp", "multi-token prediction is not implemented"),
    _warn("actor_rollout_ref.rollout.multi_stage_wake_up", "engines wake in one stage"),
    _warn_if("actor_rollout_ref.rollout.multi_turn.interaction_config_path", _is(None), "null",
             "tool calls only (rollout.multi_turn.tool_config_path)", "verl's simulated-user interactions are not "
             "implemented; multi-turn tool calls are"),
    _warn("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", MT_TEMPLATE),
    _warn("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", MT_TEMPLATE),
    _warn("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "verl's SGLang-era option; rollout.n "
          "responses per prompt"),
    _warn_if("actor_rollout_ref.rollout.over_sample_rate", _is(0, 0.0), "0", "every admitted prompt is kept",
             "over-sampling is not implemented; the staleness bound (async_training.staleness_threshold) admits "
             "extra prompts"),
    _warn_if("actor_rollout_ref.rollout.pipeline_model_parallel_size", *ONE, "no pipeline-parallel rollout",
             "use tensor_model_parallel_size"),
    _warn("actor_rollout_ref.rollout.prometheus.**", "no Prometheus exporter; metrics go to console/TensorBoard"),
    _warn("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length sets it"),
    _warn("actor_rollout_ref.rollout.response_length", "data.max_response_length sets it"),
    _warn_if("actor_rollout_ref.rollout.quantization_config_file", _is(None), "null", "verl's blockwise fp8 scheme "
             "(rollout.quantization=fp8) needs no file", "a quantization config file is not read: rollout."
             "quantization=fp8 is verl's blockwise scheme (128x128 weights, 1x128 activations); other schemes are "
             "not implemented"),
    _warn("actor_rollout_ref.rollout.enable_sleep_mode", "an engine sleeps (gives its device memory back) exactly "
          "when it shares devices with the trainer: sync and colocated modes and a shared device pool; engines on "
          "their own devices never do"),
    _warn("actor_rollout_ref.rollout.scheduling_policy", "requests are served first come, first served"),
    _warn("actor_rollout_ref.rollout.skip_dump_dir", "rollout skipping is not implemented"),
    _warn_if("actor_rollout_ref.rollout.skip_rollout", _is(False), "false", "every step generates",
             "skipping rollouts (replaying dumped ones) is not implemented"),
    _warn("actor_rollout_ref.rollout.skip_tokenizer_init", "the engines receive token ids and detokenise only "
          "for rewards"),
    _warn("actor_rollout_ref.rollout.trace.**", "rollout tracing backends are not wired; trainer.timeline=true "
          "traces the phases"),
    # ---------------------------------------------------------------- algorithm
    _warn_if("algorithm.rollout_correction.rollout_rs_threshold_lower", _is(None), "null", "an older verl's key: "
             "the k1 options take their lower bound in rollout_rs_threshold ('lower_upper')",
             "give the bound in algorithm.rollout_correction.rollout_rs_threshold as 'lower_upper'"),
    _warn_if("algorithm.rollout_correction.rollout_token_veto_threshold", _is(None), "null", "an older verl's key: "
             "no per-token veto", "reject with algorithm.rollout_correction.rollout_rs (token_k1 with a lower "
             "bound, or seq_max_k2 / seq_max_k3) instead"),
    # ---------------------------------------------------------------- async_training
    _warn("async_training.checkpoint_engine.**", "weights move by actor_rollout_ref.rollout.weight_sync "
          "(auto|object_store|collective) in buckets of rollout.update_weights_bucket_megabytes"),
    _map("async_training.compute_prox_log_prob", "async_training.decoupled_ppo", "recomputing the proximal "
         "policy's log-probs is decoupled PPO here"),
    _warn("async_training.use_trainer_do_validate", "the rollouter validates on its own engines"),
    # ---------------------------------------------------------------- critic, reward model
    *CRITIC_RULES,
    _map("reward_model.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.{0}",
         "verl's DAPO reward_kwargs spelling of our reward_model.overlong_buffer"),
    _map("reward_model.reward_kwargs.max_resp_len", "reward_model.overlong_buffer.max_resp_len",
         "verl's DAPO reference length for the overlong penalty"),
    _refuse("reward_model.reward_kwargs.**", "the reward managers take overlong_buffer_cfg.* and max_resp_len "
            "only; pass a custom function's arguments as +custom_reward_function.reward_kwargs.<name>"),
    _warn("reward_model.launch_reward_fn_async", "rewards are scored in the rollouter as each group finishes"),
    _warn("reward_model.use_reward_loop", RM_SERVED),
    _warn("reward_model.rollout.**", RM_SERVED),
    _warn("reward_model.num_workers", RM_SERVED),
    _warn("reward_model.enable_resource_pool", RM_SERVED + ", on the trainer's devices"),
    _warn("reward_model.model.use_remove_padding", "the reward model packs as the actor "
          "(actor_rollout_ref.model.use_remove_padding)"),
    _warn("reward_model.model.fsdp_config.**", "the reward model is sharded and offloaded as the actor "
          "(actor_rollout_ref.actor.fsdp_config.*)"),
    _warn("reward_model.strategy", "the reward model runs on the actor's strategy (torch / fsdp2)"),
    _warn_if("reward_model.micro_batch_size", _is(None), "null", "deprecated global micro batch",
             "use reward_model.micro_batch_size_per_gpu"),
    _warn("reward_model.**", RM),
    _map("reward.reward_manager.name", "reward_model.reward_manager", "verl's newer spelling of "
         "reward_model.reward_manager"),
    _map("reward.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.{0}",
         "verl's newer spelling of reward_model.reward_kwargs.overlong_buffer_cfg (our reward_model.overlong_buffer)"),
    _map("reward.reward_kwargs.max_resp_len", "reward_model.overlong_buffer.max_resp_len",
         "verl's newer spelling of reward_model.reward_kwargs.max_resp_len"),
    _refuse("reward.reward_kwargs.**", "the reward managers take overlong_buffer_cfg.* and max_resp_len only; pass "
            "a custom function's arguments as +custom_reward_function.reward_kwargs.<name>"),
    _warn("reward.reward_manager.**", "reward managers are the built-in naive|dapo (reward_model.reward_manager)"),
    _map("reward_manager.name", "reward_model.reward_manager", "verl's new spelling of reward_model.reward_manager"),
    _warn_if("reward_manager.module.path", _is(None), "null", "built-in managers",
             "custom reward manager classes are not implemented: use custom_reward_function.path"),
    _warn("reward_manager.**", "reward managers are the built-in naive|dapo (reward_model.reward_manager)"),
    # ---------------------------------------------------------------- data
    _warn("data.return_raw_chat", "the chat template is applied once in the driver; engines get token ids"),
    _warn("data.return_full_prompt", "prompts are kept as token ids"),
    _warn("data.return_raw_input_ids", "prompts are kept as token ids"),
    _warn("data.return_multi_modal_inputs", "text-only data"),
    _warn("data.image_key", "text-only data"),
    _warn("data.video_key", "text-only data"),
    _warn("data.image_patch_size", "text-only data"),
    _warn("data.gen_batch_size", "the rollouter admits prompts one at a time under the staleness bound "
          "(async) or generates data.train_batch_size per step (sync; with algorithm.filter_groups, further rounds "
          "draw only the groups still missing, so none is generated and left untrained)"),
    _warn("data.dataloader_num_workers", "the data is read and tokenised once in the driver"),
    _warn("data.filter_overlong_prompts_workers", "the data is read and tokenised once in the driver"),
    _warn("data.use_shm", "data is read from local files"),
    _warn("data.trust_remote_code", "actor_rollout_ref.model.trust_remote_code governs the tokenizer"),
    _warn("data.val_batch_size", "validation submits every prompt at once to the engines"),
    _warn("data.validation_shuffle", "validation prompts keep their file order"),
    _warn("data.tool_config_path", "multi-turn / tool rollouts are not implemented"),
    _warn_if("data.tokenizer", _is(None), "null", "the data is tokenized by the policy's tokenizer",
             "set actor_rollout_ref.model.tokenizer_path: one tokenizer prepares the data and the policy's batches"),
    _warn_if("data.datagen.*", _is(None), "null", "no dynamic data generation",
             "dynamic data generation is not implemented"),
    _warn_if("data.sampler.*", _is(None), "null", "data.shuffle with data.seed",
             "custom samplers (curriculum) are not implemented"),
    # ---------------------------------------------------------------- trainer, rollout placement, misc
    _warn_if("trainer.default_hdfs_dir", _is(None), "null", "local checkpoints only",
             "checkpoints are written to trainer.default_local_dir only"),
    _warn("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.max_ckpt_to_keep prunes)"),
    _warn_if("trainer.dump_high_diff_tokens", _is(False, None), "false", "a `+` key some DAPO fp8 recipes pass for "
             "a fork's debug dump; verl's trainer does not read it (training/rollout_probs_diff_* are logged every "
             "step)", "dumping the tokens with the largest rollout/trainer log-prob differences is not implemented"),
    _warn("trainer.dump_high_diff_dir", "read only with trainer.dump_high_diff_tokens=true (refused)"),
    _warn("trainer.esi_redundant_time", "no elastic-instance save deadline; SIGTERM always checkpoints"),
    _map("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    _warn("trainer.max_critic_ckpt_to_keep", "the critic is saved in the actor's checkpoint folder: "
          "trainer.max_ckpt_to_keep prunes both"),
    _warn("trainer.ray_wait_register_center_timeout", "actors are awaited with their own readiness checks"),
    _warn("trainer.use_legacy_worker_impl", "one worker implementation"),
    _warn("rollout.n", "actor_rollout_ref.rollout.n is the responses per prompt"),
    _map("ray_kwargs.ray_init.address", "multi_job.ray_address", "the Ray cluster to join (verl passes it to "
         "ray.init; a shared device pool's jobs all join one)"),
    _warn("ray_kwargs.ray_init.num_cpus", "Ray is started with the cores the placement needs (or joins "
          "RAY_ADDRESS)"),
    _warn("ray_kwargs.**", "Ray is started by the launcher; trainer.timeline=true writes a trace"),
    _warn("transfer_queue.enable", "groups move through the staleness-bounded queue (verl 0.9's V1 trainer "
          "moves them through its TransferQueue: a data plane, the same groups either way)"),
]

# values of our schema's keys that verl scripts use and that are served here by another value (warned): key ->
# {verl's value: (ours, why)}
VALUE_MAPS: dict[str, dict[str, tuple[str, str]]] = {
    "actor_rollout_ref.rollout.name": {
        name: ("vllm", f"{label} is not an engine here: the rollout runs on vLLM (vLLM-Ascend on NPU) with the same "
                       "sampling parameters (temperature, top_p, top_k, n, lengths), so the samples come from the same "
                       f"distribution; {label}'s own engine options (engine_kwargs.{name}.*) are dropped, and so is "
                       "rollout.enable_chunked_prefill, which verl's server for it never reads")
        for name, label in (("sglang", "SGLang"), ("trtllm", "TensorRT-LLM"))},
    "algorithm.filter_groups.metric": {
        "reward": ("seq_reward", "verl 0.9.1's name of the response's pre-KL reward (its token-level scores "
                   "summed), which is seq_reward here")},
}

# dict-valued schema fields that take any sub-key (`+a.b.c=...`)
OPEN_DICTS = ("actor_rollout_ref.model.override_config", "actor_rollout_ref.actor.megatron.override_transformer_config",
              "custom_reward_function.reward_kwargs", "critic.model.override_config", "data.apply_chat_template_kwargs",
              "reward_model.model.override_config")


# Keys of our schema whose default is not verl's, each with the reason.  tests/unit/verl/test_verl_compat.py
# fails for a difference missing here, so a default never drifts from verl's silently.
DEFAULT_DIFFERENCES: dict[str, str] = {
    "actor_rollout_ref.actor.clip_ratio_low": "null: falls back to actor.clip_ratio (0.2), the same bound",
    "actor_rollout_ref.actor.clip_ratio_high": "null: falls back to actor.clip_ratio (0.2), the same bound",
    "actor_rollout_ref.actor.megatron.sequence_parallel": "sequence parallelism needs tensor_model_parallel_size > 1 "
    "and a fused norm (Apex / TE / MindSpeed); verl's true is a no-op at tp=1, ours is refused there, so it is opt-in",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": "null: true over several ranks, as verl; on one "
    "rank (which shards nothing) false where every layer's compute-dtype copy is at most a tenth of the device, so "
    "no micro-batch after the first casts the weights again (core/config.keeps_gathered_layers; the update 5-8% "
    "faster on 1x H200 at the seed-003 shape).  Set, it is what verl means",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "null: off where the memory model says the update fits "
    "in 80% of the device without it (beside the engine on a shared device), on where it cannot tell "
    "(planner/memory_model.checkpoints_activations; the run logs its pick).  Recomputing costs a forward per "
    "micro-batch: the seed-003 update on 1x H200 took 4.00 s with it, 3.06 s without.  Set, it is what verl means",
    "actor_rollout_ref.model.path": "the bundled tiny model, so the no-argument run works offline",
    "actor_rollout_ref.model.use_fused_kernels": "the same float32 math as the plain path with far less memory "
    "(the logits never exist whole); models with a biased/soft-capped head fall back by themselves",
    "actor_rollout_ref.model.use_remove_padding": "packing needs a varlen attention kernel on the device and is "
    "refused with strategy=megatron; padded rows compute the same loss, so it is opt-in",
    "actor_rollout_ref.rollout.load_format": "auto loads real weights, so validation before the first weight push "
    "scores the real model; dummy is accepted (random init until the first push)",
    "actor_rollout_ref.rollout.name": "verl requires it (???); ours defaults to the embedded engine, hf",
    "actor_rollout_ref.rollout.max_num_seqs": "null: verl's 256, except the embedded engine on an accelerator, which "
    "takes the responses it may run at once per engine (sync: one step's; async: those of the groups the staleness "
    "bound lets a weight version admit), up to 1024, where gpu_memory_utilization of the device holds their "
    "full-length KV cache (planner/memory_model.engine_slots; the run logs its pick): more rows a decode step for "
    "the same weight reads.  Set, it is what verl means (the sequences an engine runs at once)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "the embedded engine has no tensor parallelism (> 1 "
    "is refused with rollout.name=hf in async mode); set it with rollout.name=vllm.  mode=sync runs one engine per "
    "trainer device at 1 whatever it says (a warning)",
    "algorithm.adv_estimator": "grpo, the estimator of verl's fully-async recipes, needs no critic; gae (PPO with a "
    "critic) is implemented: set algorithm.adv_estimator=gae",
    "critic.model.path": "null: the critic's trunk is actor_rollout_ref.model.path (verl's example path is a "
    "placeholder)",
    "data.seed": "a fixed seed makes the prompt order reproducible and resumable; verl's null draws a fresh order",
    "data.train_files": "the bundled tiny task, so the no-argument run works offline",
    "data.val_files": "the bundled tiny task, so the no-argument run works offline",
    "rollout.n_gpus_per_node": "one device: the CPU-first default (verl's 8 assumes a GPU node)",
    "rollout.test_freq": "null: the rollouter validates every trainer.test_freq param versions (verl's fully-async "
    "1 validates after every version)",
    "rollout.total_rollout_steps": "null: trainer.total_epochs passes over the data (verl's fully-async 100 is a "
    "demo value); set, the run stops at the smaller of it and the epochs, as verl's",
    "rollout.total_epochs": "null: trainer.total_epochs alone bounds the passes (verl's fully-async 10 bounds its "
    "rollouter's data iterator beside trainer.total_epochs; set it for the same second bound)",
    "trainer.device": "auto picks npu > cuda > cpu",
    "trainer.experiment_name": "our own name",
    "trainer.logger": "wandb is not wired here; the YAML logs to console and TensorBoard",
    "trainer.n_gpus_per_node": "one device: the CPU-first default (verl's 8 assumes a GPU node)",
    "trainer.project_name": "our own name",
    # verl 0.9.1 moved the reward keys under `reward.` (mapped onto these, verl/rules_09.py) and left the legacy
    # section null (unset); ours keeps the values that 0.9.1 reads from its new place
    "custom_reward_function.name": "compute_score: verl 0.9.1 leaves this legacy key null and reads "
    "reward.custom_reward_function.name (compute_score), mapped here onto this key",
    "reward_model.enable": "false: verl 0.9.1 leaves its legacy reward_model section null and reads "
    "reward.reward_model.enable (false), mapped here onto this key",
    "reward_model.model.trust_remote_code": "false: verl 0.9.1's legacy reward_model section is null (unset)",
    "reward_model.reward_manager": "naive: verl 0.9.1 leaves this legacy key null and reads "
    "reward.reward_manager.name (naive), mapped here onto this key",
    "critic.model.trust_remote_code": "follows actor_rollout_ref.model.trust_remote_code (b178a3cd's default; "
    "0.9.1's is false)",
    "algorithm.filter_groups.metric": "null: required with filter_groups.enable=true; verl 0.9.1's default "
    "`reward` (the pre-KL reward summed over the response) is served here as seq_reward, the same number",
}


# Why a verl example script is refused (tests/unit/run/test_verl_scripts.py, over tests/fixtures/verl_scripts.tsv):
# (reason as docs/verl_compat.md lists it, a regex of the key the refusal names).  A refusal naming another key
# fails that test.
SCRIPT_REFUSALS: list[tuple[str, str]] = [
    ("gae (a critic) with strategy=megatron",
     r"algorithm\.adv_estimator|critic\.strategy"),
    ("LoRA settings megatron's fused LoRA cannot take", r"actor_rollout_ref\.model\.(lora.*|target_modules|"
     r"exclude_modules)"),
    ("megatron dist checkpoints", r".*\.megatron\.(use_dist_checkpointing|dist_checkpointing_path)"),
    ("virtual pipeline stages beside a critic or a reward model", r".*\.virtual_pipeline_model_parallel_size"),
    ("rollout engines other than hf and vllm (sglang, trtllm)", r"actor_rollout_ref\.rollout\.name"),
    ("context parallelism", r".*\.megatron\.context_parallel_size"),
    ("rollout-correction keys verl itself no longer has (a recipe older than its rollout_correction API)",
     r"algorithm\.rollout_correction\.(rollout_rs_threshold_lower|rollout_token_veto_threshold)"),
    ("config missing from verl itself", r"--config-name"),
    ("an override Hydra cannot parse (in verl too)", r"hydra-grammar"),
    # verl 0.9's scripts (tests/fixtures/verl_scripts_0_9.tsv)
    ("an override verl's own config cannot take either (an empty value, a key verl does not have)",
     r"hydra-compose|actor_rollout_ref\.rollout\.single_turn_response_length"),
    ("verl 0.9's engines other than fsdp and megatron (VeOmni, FSDP-turbo, megatron-lite, Megatron-FSDP)",
     r"(actor_rollout_ref\.actor\.)?model_engine|actor_rollout_ref\.actor\.(engine\..*|fsdp_config\.turbo_config\..*|"
     r"megatron\.use_megatron_fsdp)"),
    ("mixture-of-experts parallelism in the rollout (expert / MoE tensor parallel)",
     r"actor_rollout_ref\.rollout\.(expert_parallel_size|moe_tensor_parallel_size)"),
    ("data parallelism inside one rollout engine", r"actor_rollout_ref\.rollout\.data_parallel_size"),
    ("multi-token prediction", r"actor_rollout_ref\.model\.mtp\.enable"),
    ("on-policy distillation", r"distillation\.enabled"),
    ("dynamic resource scheduling (verl 0.9's fully-async)", r"async_training\.use_dynamic_resource_scheduling"),
    ("a V1 cap on the versions a group spans (max_off_policy_threshold >= 2)",
     r"trainer\.v1\.sampler\.max_off_policy_threshold"),
    ("packing under megatron (Transformer Engine's THD attention)", r"actor_rollout_ref\.model\.use_remove_padding"),
    ("activation offload, shared-prefix grouping, an absolute lr floor (min_lr)",
     r"actor_rollout_ref\.model\.enable_activation_offload|"
     r"actor_rollout_ref\.actor\.(use_prefix_grouper|optim\.min_lr)"),
    ("a setting checked here that verl checks later or not at all (one response with a group estimator, fewer "
     "groups than data-parallel ranks, a token budget below one sequence)",
     r"actor_rollout_ref\.rollout\.(n|max_num_batched_tokens)|actor_rollout_ref\.actor\.(ppo_mini_batch_size|"
     r"ppo_max_token_len_per_gpu)"),
    ("a reward manager not built in here (gdpo: use algorithm.adv_estimator=gdpo with a reward function's keys)",
     r"reward_model\.reward_manager"),
]
