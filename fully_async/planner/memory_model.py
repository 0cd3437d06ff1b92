"""Device memory of each role, estimated from the config and the model's shape (layer 1, pure arithmetic).

What is counted, per device, in bytes (P = parameters of the device's shard, h/I = hidden/intermediate sizes):

  trainer, strategy torch   params, grads and both AdamW moments in actor.dtype: 4 x P x bytes(dtype).  The peak is
                            in a later step's forward/backward (optimizer states exist); grads coexist with a
                            micro-batch's activations when a mini-batch has several micro-batches, otherwise
                            only what exceeds the activations counts
                            (+ the reference model's params when use_kl_loss)
  trainer, strategy fsdp2   float32 master params, grads and moments sharded over the data-parallel ranks:
                            16 x P / dp, plus two gathered layers in actor.dtype (the layer computing, the
                            next one prefetched); the reference model sharded the same way (4 x P / dp)
  trainer, strategy megatron  bf16 params 2P + float32 grad buffer 4P + float32 master and moments 12P
                            (sharded over dp with use_distributed_optimizer), P = the largest pipeline stage's
                            parameters / tensor parallel size (stage 0 holds the embedding)
  critic                    (algorithm.adv_estimator=gae) the value model's params, grads and AdamW moments (megatron:
                            its trunk in the actor's layout, params bf16 + fp32 grads + AdamW/master), held the
                            same way as the actor's (fsdp2 16 x Pc / dp, torch 4 x Pc x bytes(dtype)), Pc = P
                            without an untied lm_head (the value head has one output); its grads counted as resident
                            (an upper bound: they are freed after each critic step).  Its activations are not added:
                            the critic's and the actor's updates run one after the other, and the actor's (with
                            the logits) are the larger.  The critic's shape is taken as the actor's
  activations               one micro-batch (ppo_max_token_len_per_gpu tokens with use_dynamic_bsz, else
                            ppo_micro_batch_size_per_gpu x (max_prompt_length + max_response_length)); per
                            token and layer the tensors autograd keeps for backward, counted with saved-tensor
                            hooks on the Hugging Face Qwen2 layer (sdpa; scripts/measure_saved_activations.py):
                            eager 4I + 4h + 2q + 2kv elements in the compute dtype (MLP gate/up/activation/
                            product; norm outputs, attention input/output, o_proj input; q, k, v) plus 2h float32
                            (each RMSNorm keeps its input upcast) -- for the 0.5B shape 57,344 bytes in bfloat16
                            (the hooks count 57,408: + the attention's float32 logsumexp and the norms' 1/rms);
                            compiled (actor.use_torch_compile with strategy torch/fsdp2 on CUDA, where the trainer
                            compiles each layer with inductor; NPU and CPU run eagerly) 3I + 4h + 2q + 2kv in the
                            compute dtype and no float32 copy (inductor's partitioner recomputes the SwiGLU
                            activation and the norms' upcast in backward) -- 40,448 bytes for the 0.5B shape
                            (hooks: 40,512); with gradient checkpointing h per layer (the layer input; measured
                            1,792 bytes), compiled or not, plus one layer's eager set (the recomputed layer and
                            its backward's transients; measured within 1% with compiled layers too).
                            Logits: the fused chunked head (model.use_fused_kernels) keeps ~3 float32 chunks of
                            2^26 elements; without it tokens x vocab x 4 bytes x 2 (logits and their gradient)
  engine, rollout.name=hf   weights in rollout.dtype + a static slot KV cache of max_num_seqs x max_model_len
                            tokens + float32 logits of every slot (max_num_seqs unset: engine_slots' count, the
                            responses it may run at once -- sync one step's, async what the staleness bound lets
                            a version admit -- per engine, where gpu_memory_utilization of the device holds them)
  engine, rollout.name=vllm gpu_memory_utilization x capacity (vLLM takes that fraction at start-up); the check
                            is that weights / tp leave room for the KV cache of max_num_seqs full sequences
                            (rollout.quantization=fp8: the layers' linear weights in one byte each)
  sync (colocated)          the larger of the generate phase (engine + what the trainer keeps resident: params
                            and grads unless param_offload, optimizer states unless optimizer_offload; strategy
                            torch / megatron offload everything when either is set) and the
                            train phase (trainer + the engine's weights and KV unless free_cache_engine)
Plus `context_gib` per device (the runtime's own context and allocator slack; an assumption, printed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from fully_async.core.config import VERL_MAX_NUM_SEQS, fsdp_backend, keeps_gathered_layers, prefills_packed, uses_critic
from fully_async.core.plan import RunPlan
from fully_async.planner.hardware import Shape

GIB = 1024 ** 3
# the chunked log-prob's elements per chunk by device, as train/backends/token_stats.py chunks (a test keeps the
# two equal; this layer cannot import the trainer's)
DEVICE_CHUNK_ELEMS = {"cuda": 2 ** 28}
EAGER_CHUNK_ELEMS = 2 ** 26
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RoleMemory:
    role: str
    parts: dict[str, float] = field(default_factory=dict)     # name -> bytes
    note: str = ""
    strategy: str = ""      # the trainer's backend (torch | fsdp2 | megatron), as selected at its dp size

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def as_dict(self) -> dict:
        return {"role": self.role, "parts_gib": {k: v / GIB for k, v in self.parts.items()},
                "total_gib": self.total / GIB, "note": self.note}


def _bytes(key: str, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{key}={dtype!r}: the memory model knows {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def micro_batch_tokens(cfg: Any, dp: int) -> int:
    """Tokens of one training micro-batch on one device (the activation footprint's driver)."""
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz:
        return int(actor.ppo_max_token_len_per_gpu)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    rows = actor.ppo_micro_batch_size_per_gpu
    if rows is None:  # the whole mini-batch share of this rank
        rows = max(1, actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n // dp)
    return int(rows) * seq


def accumulates(cfg: Any, dp: int) -> bool:
    """Whether gradients of earlier micro-batches stay allocated while a later one runs forward (several
    micro-batches per mini-batch); with dynamic batch sizes assumed so."""
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz or actor.ppo_micro_batch_size_per_gpu is None:
        return bool(actor.use_dynamic_bsz)
    rows = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n // dp
    return actor.ppo_micro_batch_size_per_gpu < rows


def activation_bytes(shape: Shape, tokens: int, cbytes: int, checkpointing: bool, fused_head: bool,
                     layers: int | None = None, chunk_elems: int = EAGER_CHUNK_ELEMS,
                     compiled: bool = False) -> tuple[float, float]:
    """(layer activations, logits) bytes of one micro-batch of `tokens` tokens over `layers` layers.

    compiled: the layers run as torch.compile (inductor) programs, which save less than eager PyTorch: the min-cut
    partitioner recomputes the SwiGLU activation (one I-sized tensor) and drops both RMSNorms' float32 input
    copies (2h float32) -- measured with saved-tensor hooks on CPU inductor (scripts/measure_saved_activations.py),
    whose partitioner is CUDA's.  With checkpointing only the layer inputs stay either way; the one layer recomputed
    in backward keeps the eager count, which matched the measured compiled + checkpointed peak (-0.9%, 1x H100).
    Not counted: with padded rows (no use_remove_padding) transformers passes sdpa a mask, so k and v are saved
    repeated to the query heads (2q instead of 2kv) plus a per-layer (L, L) mask per row in the compute dtype; by
    the hooks (CPU, padded rows) that is nearly all of what the 0.5B trainer's estimate misses against its
    measured peaks (-5.5% eager, -7.6% compiled, 1x H100; with it, by arithmetic, both within 1%)."""
    layers = shape.layers if layers is None else layers
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, inter = shape.hidden, shape.intermediate
    eager = ((4 * h + 2 * q + 2 * kv + 4 * inter) * cbytes + 2 * 4 * h) * tokens
    if checkpointing:
        acts = layers * h * cbytes * tokens + eager
    elif compiled:
        acts = layers * (4 * h + 2 * q + 2 * kv + 3 * inter) * cbytes * tokens
    else:
        acts = layers * eager
    if fused_head:
        logits = 3 * 4 * min(chunk_elems, tokens * shape.vocab)
    else:
        logits = 2 * 4 * tokens * shape.vocab
    return float(acts), float(logits)


def _strategy(strategy: str, dp: int, dtype: str) -> str:
    """The backend a strategy selects at `dp` trainer devices (verl's fsdp: core.config.fsdp_backend)."""
    return fsdp_backend(dp, dtype) if strategy == "fsdp" else strategy


# actor_rollout_ref.model.enable_gradient_checkpointing unset: off where the trainer's peak without it (and, on a
# device it shares with an engine, the engine's memory) is at most this share of the device
RECOMPUTE_SHARE = 0.8


def checkpoints_activations(cfg: Any, shape: Shape, dp: int, capacity_bytes: Optional[float]) -> bool:
    """actor_rollout_ref.model.enable_gradient_checkpointing as the trainer applies it: as set; unset (null), off
    where the memory model's peak of a trainer device without it fits in RECOMPUTE_SHARE of `capacity_bytes`, with the
    engine's whole memory beside it where the trainer shares its devices with an engine (sync, colocated, elastic:
    turning recompute off must not push the engine out at a turn switch); on where the capacity is unknown (verl's
    default).  Recomputing costs a forward per micro-batch: the seed-003 update on 1x H200 took 4.00 s with it, 3.06 s
    without (docs/measurements/engine_decode_h200/update_seed003.json)."""
    flag = cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    if flag is not None:
        return bool(flag)
    if capacity_bytes is None:
        return True
    need = trainer_memory(cfg, shape, dp, capacity_bytes, checkpointing=False).total
    if RunPlan.of(cfg).placement in ("colocated", "elastic"):
        need += engine_memory(cfg, shape, capacity_bytes).total
    return need > RECOMPUTE_SHARE * capacity_bytes


def trainer_memory(cfg: Any, shape: Shape, dp: int, capacity_bytes: Optional[float] = None,
                   checkpointing: Optional[bool] = None) -> RoleMemory:
    """Peak memory of one trainer device while it trains (module docstring); `capacity_bytes`, the device's, decides
    whether a lone fsdp2 rank keeps its layers gathered (config.keeps_gathered_layers; unknown: taken as kept) and
    whether an unset enable_gradient_checkpointing recomputes (checkpoints_activations; `checkpointing` overrides)."""
    actor, model = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model
    if checkpointing is None:
        checkpointing = checkpoints_activations(cfg, shape, dp, capacity_bytes)
    cbytes = _bytes("actor_rollout_ref.actor.dtype", actor.dtype)
    P = shape.params()
    ref = bool(actor.use_kl_loss)
    mem = RoleMemory("trainer")
    layers = shape.layers
    strategy = _strategy(actor.strategy, dp, actor.dtype)
    size = actor.fsdp_config.fsdp_size
    shard = size if 0 < size < dp and dp % size == 0 else dp   # FSDP2's shard group (hybrid sharding: fsdp_size)
    mem.strategy = strategy
    if strategy == "megatron":
        m = actor.megatron
        tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        layers = -(-shape.layers // pp)
        stage = (layers * shape.layer_params() + shape.vocab * shape.hidden * (1 if pp > 1 or shape.tied else 2)) / tp
        opt_shard = dp if m.use_distributed_optimizer else 1
        mem.parts.update(params=2 * stage, grads=4 * stage, optimizer=12 * stage / opt_shard)
        if ref:
            mem.parts["ref_params"] = 2 * stage
        mem.note = f"megatron tp={tp} pp={pp} dp={dp}" + (", distributed optimizer" if opt_shard > 1 else "")
        tokens = micro_batch_tokens(cfg, dp) // tp if m.sequence_parallel else micro_batch_tokens(cfg, dp)
    elif strategy == "fsdp2":
        # sharded over the world, or (fsdp_size, verl's hybrid sharding) within groups of fsdp_size ranks
        # gathered in the compute dtype: the layer in use and the next (prefetch); without resharding after forward
        # every layer stays gathered from its forward to its backward
        every_layer = shape.layers * shape.layer_params() * cbytes
        room = None if actor.fsdp_config.offload_policy else float("inf") if capacity_bytes is None else capacity_bytes
        kept = keeps_gathered_layers(actor.fsdp_config, dp, every_layer, room)
        # (a kept lone rank is one FSDP2 group: its compute-dtype gradients, as large as the kept copy, all exist at
        # the end of a backward, before they are added into float32; the activations are freed by then, so the peak
        # stays the forward's below)
        gathered = shape.layers if kept else 2
        mem.parts.update(params=4 * P / shard, grads=4 * P / shard, optimizer=8 * P / shard,
                         gathered_layers=gathered * shape.layer_params() * cbytes)
        if ref:
            mem.parts["ref_params"] = 4 * P / shard
        mem.note = (f"fsdp2 over dp={dp}" + (f", hybrid: sharded within groups of {shard}" if shard < dp else "")
                    + f" (float32 master, compute in {actor.dtype})")
        sp = actor.ulysses_sequence_parallel_size if dp % actor.ulysses_sequence_parallel_size == 0 else 1
        # Ulysses: a group of sp devices shares one micro-batch (a token budget is per device already)
        tokens = micro_batch_tokens(cfg, dp // sp) // (1 if actor.use_dynamic_bsz else sp)
        mem.note += f", Ulysses sp={sp}" if sp > 1 else ""
    else:
        mem.parts.update(params=cbytes * P, grads=cbytes * P, optimizer=2 * cbytes * P)
        if ref:
            mem.parts["ref_params"] = cbytes * P
        mem.note = f"torch, one device, params/grads/AdamW in {actor.dtype}"
        tokens = micro_batch_tokens(cfg, dp)
    rank = model.lora_rank
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if rank and strategy != "megatron":   # LoRA: only the adapters (all linear layers at most) have grads and AdamW
        adapter = shape.layers * rank * (7 * shape.hidden + 2 * q + 2 * kv + 3 * shape.intermediate)
        share = shard if strategy == "fsdp2" else 1
        mem.parts.update(grads=4 * adapter / share, optimizer=8 * adapter / share)
        mem.note += f"; LoRA rank {rank}: grads and AdamW for {adapter / 1e6:.1f}M adapter parameters"
    elif rank:   # megatron's fused adapters (one per qkv/proj/fc1/fc2) on this stage, split with their layer over tp;
        #          float32 grads, masters and AdamW states; the reference is the base with its adapters off
        adapter = layers * rank * (4 * shape.hidden + 2 * q + 2 * kv + 3 * shape.intermediate) / tp
        mem.parts.update(grads=4 * adapter, optimizer=12 * adapter / opt_shard)
        mem.parts.pop("ref_params", None)
        mem.note += f"; LoRA rank {rank}: grads and AdamW for {adapter / 1e6:.1f}M adapter parameters per device"
    if uses_critic(cfg) and strategy == "megatron":   # the same layout: the trunk's stage without the LM head
        trunk = stage - shape.vocab * shape.hidden * (0 if pp > 1 or shape.tied else 1) / tp
        mem.parts.update(critic_params=2 * trunk, critic_grads=4 * trunk, critic_optimizer=12 * trunk / opt_shard)
        mem.note += "; critic (value model) beside the actor"
    elif uses_critic(cfg):
        mem.parts.update(critic_memory(shape, strategy, shard, cbytes))
        mem.note += "; critic (value model) beside the actor"
    if cfg.reward_model.enable and strategy == "megatron":   # frozen, the same layout; scores the batch
        mem.parts["rm_params"] = 2 * stage
    if strategy == "fsdp2" and actor.fsdp_config.offload_policy and cfg.trainer.device != "cpu":
        # FSDP2's CPUOffloadPolicy: the shards, their grads and AdamW states (the reference's and critic's too) live
        # in host memory; the device holds the layers gathered for compute
        for key in ("params", "grads", "optimizer", "ref_params", "critic_params", "critic_grads", "critic_optimizer"):
            if key in mem.parts:
                mem.parts[key] = 0.0
        mem.note += "; offload_policy: shards, grads and AdamW states in host memory"
    # the torch backend (torch and fsdp2) compiles each decoder layer where the device has inductor: CUDA
    # (train/backends/torch_backend.compile_decoder_layers); NPU and CPU, and megatron, run the layers eagerly
    compiled = bool(actor.use_torch_compile) and cfg.trainer.device == "cuda" and strategy != "megatron"
    acts, logits = activation_bytes(shape, tokens, cbytes, checkpointing,
                                    bool(model.use_fused_kernels), layers,
                                    DEVICE_CHUNK_ELEMS.get(cfg.trainer.device, EAGER_CHUNK_ELEMS), compiled)
    mem.parts.update(activations=acts, logits=logits)
    if not accumulates(cfg, dp):  # one micro-batch per optimizer step: grads appear only as activations are freed
        mem.parts["grads"] = max(0.0, mem.parts["grads"] - acts - logits)
        mem.note += "; one micro-batch per optimizer step (grads replace activations)"
    mem.note += f"; micro-batch {tokens} tokens" + (", gradient checkpointing" if checkpointing
                                                     else "") + (", compiled layers" if compiled else "")
    return mem


def critic_memory(shape: Shape, strategy: str, dp: int, cbytes: int) -> dict[str, float]:
    """The critic's resident parts on one trainer device (module docstring: critic)."""
    pc = shape.params() - (0 if shape.tied else shape.vocab * shape.hidden)
    if strategy == "fsdp2":
        return {"critic_params": 4 * pc / dp, "critic_grads": 4 * pc / dp, "critic_optimizer": 8 * pc / dp}
    return {"critic_params": cbytes * pc, "critic_grads": cbytes * pc, "critic_optimizer": 2 * cbytes * pc}


# the decode graphs' memory pool plus the cuBLAS workspaces of the two capture streams, measured on 1x H100
# (0.5B shape, 56 graphs of 14 batch x 4 span buckets: 0.11 GiB over the same engine decoding eagerly); it hardly
# depends on the model (each graph's intermediates are one layer's, freed within the graph)
DECODE_GRAPHS_BYTES = 0.11 * GIB


def max_model_len(cfg: Any) -> int:
    r = cfg.actor_rollout_ref.rollout
    return int(r.max_model_len or (cfg.data.max_prompt_length + cfg.data.max_response_length))


def longest_prefill(cfg: Any) -> int:
    """The longest request the embedded engine prefills in one piece: a prompt, or, where a weight update aborts the
    responses in flight (async, partial_rollout, pause_mode=abort: verl's defaults), a prompt with its partial
    response, up to max_model_len - 1 tokens; where it prefills packed and splits a longer request over steps
    (rollout.enable_chunked_prefill on CUDA in 16-bit with the fused decode: rollout/engines/prefill.py), at most the
    budget."""
    r, at = cfg.actor_rollout_ref.rollout, cfg.async_training
    longest = max_model_len(cfg) - 1 if cfg.mode == "async" and at.partial_rollout and r.pause_mode == "abort" \
        else int(cfg.data.max_prompt_length)
    return min(longest, r.max_num_batched_tokens) if prefills_packed(cfg) and r.enable_chunked_prefill else longest


def engine_weight_bytes(cfg: Any, shape: Shape) -> float:
    """One engine's weights: rollout.dtype, except vLLM's fp8 rollout (rollout.quantization=fp8), whose linear
    layers hold one byte per weight plus a float32 scale per 128x128 block (the embedded engine only emulates fp8:
    its weights stay in rollout.dtype)."""
    r = cfg.actor_rollout_ref.rollout
    wbytes = _bytes("actor_rollout_ref.rollout.dtype", r.dtype)
    total = float(shape.params() * wbytes)
    if r.quantization == "fp8" and r.name == "vllm":
        linear = shape.linear_weights()
        total -= linear * (wbytes - 1 - 4 / 128 ** 2)
    return total


def engine_memory(cfg: Any, shape: Shape, capacity_bytes: float, slots: int | None = None) -> RoleMemory:
    """Memory of one rollout device (a replica spans rollout.tensor_model_parallel_size devices) with `slots`
    sequences (default: max_num_seqs, or what engine_slots sizes for this capacity where it is unset)."""
    r = cfg.actor_rollout_ref.rollout
    wbytes = _bytes("actor_rollout_ref.rollout.dtype", r.dtype)
    tp = r.tensor_model_parallel_size
    seqs = slots if slots is not None else (r.max_num_seqs if r.max_num_seqs is not None else
                                            engine_slots(cfg, shape, capacity_bytes)[0])
    weights = engine_weight_bytes(cfg, shape) / tp
    kv_needed = seqs * max_model_len(cfg) * shape.kv_bytes_per_token(wbytes) / tp
    mem = RoleMemory("engine")
    if r.name == "vllm":
        reserved = r.gpu_memory_utilization * capacity_bytes
        mem.parts.update(weights=weights, kv_cache=max(0.0, reserved - weights))
        mem.note = (f"vllm takes gpu_memory_utilization={r.gpu_memory_utilization:g} of the device; "
                    f"{seqs} full-length sequences need {kv_needed / GIB:.2f} GiB of KV per device")
        mem.kv_needed = kv_needed  # type: ignore[attr-defined]
    else:
        # one admission prefills up to max_num_seqs requests at once, at most max_num_batched_tokens tokens (a
        # longer request alone): one layer's live tensors per token (residual + hidden, and the MLP's gate, up and
        # their product), freed layer by layer
        longest = longest_prefill(cfg)
        tokens = max(min(seqs * longest, r.max_num_batched_tokens), longest)
        prefill = tokens * (2 * shape.hidden + 3 * shape.intermediate) * wbytes
        mem.parts.update(weights=weights, kv_cache=kv_needed, logits=4.0 * seqs * shape.vocab,
                         prefill=prefill / tp)
        if not r.enforce_eager and cfg.trainer.device != "cpu":
            mem.parts["decode_graphs"] = DECODE_GRAPHS_BYTES
        mem.note = f"embedded engine: slot KV cache of {seqs} x {max_model_len(cfg)} tokens"
    return mem


AUTO_MAX_NUM_SEQS = 1024   # the most slots engine_slots gives one engine (a decode step's latency grows with them)


def engine_slots(cfg: Any, shape: Shape, capacity_bytes: float) -> tuple[int, str]:
    """(slots, why): what actor_rollout_ref.rollout.max_num_seqs=null gives each engine on devices of
    `capacity_bytes`.  The embedded engine on an accelerator: the responses the rollouter may run at once on each
    replica -- sync: one step's (the groups a step trains x rollout.n); async: the groups the staleness bound lets
    one weight version admit (max_required_samples) x rollout.n, since its rollouter runs ahead of the trainer by
    up to that many -- over the engine replicas, at most AUTO_MAX_NUM_SEQS (an async engine on the trainer's
    devices: beyond one step's, only as many as `_room_beside_trainer` holds), as many as fit in
    rollout.gpu_memory_utilization of the device beside its weights, prefill and graphs (each slot holds a
    full-length KV cache and a float32 row of logits), never fewer than verl's 256 (nor than the largest
    rollout.cudagraph_capture_sizes: rollout/engine_fit.py checks those against the whole device, as it checks a
    size that is set).  vLLM (it pages its KV cache: the slot count is only its cap) and the cpu: verl's 256.  A
    larger decode batch reads each weight once for more tokens, so on an accelerator the engine's tokens per second
    grow with it while the KV read of every slot stays the same per token."""
    r = cfg.actor_rollout_ref.rollout
    graphs = max(r.cudagraph_capture_sizes or [0])   # the largest decode graph asked for gets its slots
    if r.name != "hf" or cfg.trainer.device == "cpu":
        why = "vLLM pages its KV cache" if r.name == "vllm" else ("a user engine" if ":" in r.name else "a cpu engine")
        return max(VERL_MAX_NUM_SEQS, graphs), f"verl's default: {why}"
    plan = RunPlan.of(cfg)
    replicas = max(1, plan.engine_devices // max(1, r.tensor_model_parallel_size))
    per_step = plan.groups_per_step * r.n
    basis = f"one step's {per_step} responses"
    running = per_step
    if cfg.mode == "async":
        from fully_async.core.staleness import StalenessManager

        bound = StalenessManager.from_config(cfg).max_admitted
        running = bound * r.n
        basis = f"the {running} responses of the {bound} groups the staleness bound lets a version admit"
    want, one_step = (min(AUTO_MAX_NUM_SEQS, max(VERL_MAX_NUM_SEQS, -(-n // replicas))) for n in (running, per_step))
    parts = engine_memory(cfg, shape, capacity_bytes, slots=want).parts
    per_slot = (parts["kv_cache"] + parts["logits"]) / want
    fixed = sum(parts.values()) - per_slot * want     # weights, prefill (its budget's worth) and graphs
    fit = int((r.gpu_memory_utilization * capacity_bytes - fixed) // per_slot)
    why = (f"{basis} over {replicas} engine(s), at least verl's {VERL_MAX_NUM_SEQS}, at most "
           f"{AUTO_MAX_NUM_SEQS}; {fit} full-length sequences fit in gpu_memory_utilization="
           f"{r.gpu_memory_utilization:g} of {capacity_bytes / GIB:.0f} GiB")
    if want > one_step and plan.placement in ("colocated", "elastic"):
        # beside the trainer, slots beyond one step's grow only into memory the trainer leaves: neither turning its
        # unset recompute on nor pushing the engine out at a turn switch (what more slots would cost a memory-bound
        # device is more than they give)
        beside = int((_room_beside_trainer(cfg, shape, capacity_bytes) - fixed) // per_slot)
        if beside < min(want, fit):
            fit = min(fit, max(beside, one_step))
            why += f"; {max(beside, 0)} beside the trainer's estimated peak (one step's {one_step} at least)"
    slots = max(VERL_MAX_NUM_SEQS, min(want, fit), graphs)
    return slots, why


def _room_beside_trainer(cfg: Any, shape: Shape, capacity_bytes: float) -> float:
    """Device bytes an engine sharing a device with the trainer may hold without turning an unset recompute on
    (`checkpoints_activations`: the trainer without it and the engine within RECOMPUTE_SHARE of the device) or being
    freed at the trainer's first turn (device_memory/policy.py: the memory model's estimate of the trainer, 20% over
    with its context, and the margin beside both)."""
    from fully_async.device_memory.policy import KeepWhenFits

    flag = cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    resident = (capacity_bytes - trainer_estimate_bytes(cfg, shape, capacity_bytes, checkpointing=bool(flag))
                - KeepWhenFits("auto").margin(int(capacity_bytes)))
    if flag is not None:
        return resident
    trainer = trainer_memory(cfg, shape, trainer_dp(cfg), capacity_bytes, checkpointing=False).total
    return min(resident, RECOMPUTE_SHARE * capacity_bytes - trainer)


def colocated_memory(cfg: Any, trainer: RoleMemory, engine: RoleMemory) -> RoleMemory:
    """Sync mode: one device holds both (module docstring)."""
    off = cfg.actor_rollout_ref.actor.fsdp_config
    keep = {k: v for k, v in trainer.parts.items() if k in ("params", "grads", "ref_params", "gathered_layers",
                                                            "critic_params", "critic_grads")}
    if off.param_offload:
        keep = {k: v for k, v in keep.items() if k == "gathered_layers"}
    if not off.optimizer_offload:
        keep.update({k: v for k, v in trainer.parts.items() if k in ("optimizer", "critic_optimizer")})
    if trainer.strategy in ("torch", "megatron") and (off.param_offload or off.optimizer_offload):
        keep = {}   # these backends' offload() moves everything (params, grads, optimizer, reference) at once
    gen = engine.total + sum(keep.values())
    engine_kept = 0.0 if cfg.actor_rollout_ref.rollout.free_cache_engine else engine.total
    train = trainer.total + engine_kept
    mem = RoleMemory("sync (colocated)")
    if gen >= train:
        mem.parts.update({f"engine.{k}": v for k, v in engine.parts.items()})
        mem.parts.update({f"trainer.{k}": v for k, v in keep.items()})
        mem.note = "peak while generating (trainer state resident" + (", params offloaded" if off.param_offload
                                                                      else "") + ")"
    else:
        mem.parts.update({f"trainer.{k}": v for k, v in trainer.parts.items()})
        if engine_kept:
            mem.parts.update({f"engine.{k}": v for k, v in engine.parts.items()})
        mem.note = "peak while training" + ("" if engine_kept else " (engine freed: free_cache_engine=true)")
    return mem


CO_TENANT_CONTEXT_GIB = 1.0    # a process's context and library workspaces (what a pool job adds to its estimate)
CO_TENANT_OVER = 1.2           # the estimate a pool job declares before it measures: 20% over the model


def trainer_dp(cfg: Any, devices: int | None = None) -> int:
    """The trainer's data-parallel size on `devices` (default: the trainer's own, trainer.nnodes x n_gpus_per_node):
    megatron's tensor x pipeline parallel ranks hold one replica."""
    actor = cfg.actor_rollout_ref.actor
    mp = (actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size
          if actor.strategy == "megatron" else 1)
    if devices is None:
        devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    return max(1, devices // mp)


def trainer_estimate_bytes(cfg: Any, shape: Shape, capacity_bytes: Optional[float] = None,
                           checkpointing: Optional[bool] = None) -> float:
    """What the trainer's peak is taken to be per device before it is measured (device_memory/policy.py: the first
    switch of free_cache_engine=true keeps the engine resident only where this fits beside it): the model's
    estimate with its context, 20% over, as a pool job declares (co_tenant_need_gib).  `checkpointing` as
    trainer_memory's (None: the run's own, checkpoints_activations)."""
    return CO_TENANT_OVER * (trainer_memory(cfg, shape, trainer_dp(cfg), capacity_bytes, checkpointing).total
                             + CO_TENANT_CONTEXT_GIB * GIB)


def co_tenant_need_gib(cfg: Any, shape: Shape, dp: int, capacity_bytes: float) -> float:
    """What a sync job on a device pool declares per device before anything is measured (multi_job.co_tenancy,
    placement/leases.py): its trainer and engines on at once, plus its context, 20% over."""
    both = trainer_memory(cfg, shape, dp, capacity_bytes).total + engine_memory(cfg, shape, capacity_bytes).total
    return CO_TENANT_OVER * (both / GIB + CO_TENANT_CONTEXT_GIB)


def co_tenant_usable_gib(capacity_gib: float, margin_fraction: float = 0.1, margin_min_gib: float = 2.0) -> float:
    """What the pool lets co-tenants declare together on a device (leases.LeaseBook.usable_gib's rule)."""
    return capacity_gib - max(margin_min_gib, margin_fraction * capacity_gib)


def verdict(total_bytes: float, capacity_bytes: float, warn_fraction: float = 0.9) -> str:
    """fits | tight (over warn_fraction of capacity) | does not fit."""
    if total_bytes > capacity_bytes:
        return "does not fit"
    return "tight" if total_bytes > warn_fraction * capacity_bytes else "fits"
