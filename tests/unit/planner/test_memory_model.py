"""Parameter counts of the built-in shapes against the published model sizes, and the memory model's
per-role arithmetic (sharding, offload, checkpointing, compiled layers, engines)."""
import os
import shutil

import pytest

from fully_async.planner.hardware import MODEL_SHAPES, Shape, known_shape
from fully_async.planner.memory_model import GIB, RoleMemory, activation_bytes, colocated_memory, engine_memory, \
    trainer_memory, verdict
from fully_async.run.hydra_setup import load_config

# parameter counts of the released checkpoints (safetensors metadata on the Hub)
PUBLISHED = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-7B": 7_615_616_512,
             "Qwen3-4B": 4_022_468_096, "Qwen3-8B": 8_190_735_360}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_shapes_count_the_published_parameters(name):
    assert Shape.of(MODEL_SHAPES[name]).params() == PUBLISHED[name]


def test_known_shape_accepts_hub_names():
    assert known_shape("Qwen/Qwen2.5-7B-Instruct")[0] == "Qwen2.5-7B"
    assert known_shape("/models/qwen3-8b")[0] == "Qwen3-8B"
    assert known_shape("/models/llama-7b") is None


def cfg(*overrides):
    return load_config(["actor_rollout_ref.model.path=Qwen2.5-7B", "data.max_prompt_length=1024",
                        "data.max_response_length=3072", *overrides])


SHAPE = Shape.of(MODEL_SHAPES["Qwen2.5-7B"])
P = SHAPE.params()


def test_torch_strategy_keeps_params_grads_and_moments_in_the_actor_dtype():
    m = trainer_memory(cfg("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.strategy=torch"), SHAPE, 1)
    assert m.parts["params"] + m.parts["grads"] + m.parts["optimizer"] == 8 * P
    # verl's fsdp on one bf16 device: a one-rank fsdp2, float32 masters (16 bytes a parameter)
    one_rank = trainer_memory(cfg("actor_rollout_ref.actor.dtype=bfloat16"), SHAPE, 1)
    assert one_rank.parts["params"] + one_rank.parts["grads"] + one_rank.parts["optimizer"] == 16 * P
    m32 = trainer_memory(cfg("actor_rollout_ref.actor.dtype=float32"), SHAPE, 1)
    assert m32.parts["optimizer"] == 8 * P


def test_fsdp2_shards_float32_state_over_data_parallel_ranks():
    c = cfg("actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.dtype=bfloat16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    m8 = trainer_memory(c, SHAPE, 8)
    assert m8.parts["params"] + m8.parts["grads"] + m8.parts["optimizer"] == pytest.approx(16 * P / 8)
    assert trainer_memory(c, SHAPE, 16).total < m8.total
    # without resharding after forward every layer stays gathered (bf16) from its forward to its backward
    kept = trainer_memory(cfg("actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.dtype=bfloat16",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                              "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"), SHAPE, 8)
    assert m8.parts["gathered_layers"] == 2 * 2 * SHAPE.layer_params()
    assert kept.parts["gathered_layers"] == SHAPE.layers * 2 * SHAPE.layer_params()
    # offload_policy (FSDP2's CPUOffloadPolicy) on an accelerator: shards, grads and AdamW states in host memory
    host = trainer_memory(cfg("actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.dtype=bfloat16",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.device=cuda",
                              "actor_rollout_ref.actor.use_kl_loss=true",
                              "actor_rollout_ref.actor.fsdp_config.offload_policy=true"), SHAPE, 8)
    assert host.parts["params"] == host.parts["grads"] == host.parts["optimizer"] == host.parts["ref_params"] == 0
    assert host.parts["gathered_layers"] == m8.parts["gathered_layers"] and "offload_policy" in host.note
    # reshard_after_forward unset on one rank: kept gathered where every layer's bf16 copy is at most a tenth of the
    # device (unknown capacity: counted as kept); resharded over several ranks, on a small device, or host-resident
    one = ("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    every = SHAPE.layers * 2 * SHAPE.layer_params()
    assert trainer_memory(cfg(*one), SHAPE, 1).parts["gathered_layers"] == every
    assert trainer_memory(cfg(*one), SHAPE, 1, capacity_bytes=10 * every).parts["gathered_layers"] == every
    assert trainer_memory(cfg(*one), SHAPE, 1, capacity_bytes=9 * every).parts["gathered_layers"] == 4 * SHAPE.layer_params()
    assert trainer_memory(cfg(*one), SHAPE, 2).parts["gathered_layers"] == 4 * SHAPE.layer_params()
    assert trainer_memory(cfg(*one, "actor_rollout_ref.actor.fsdp_config.offload_policy=true"), SHAPE, 1
                          ).parts["gathered_layers"] == 4 * SHAPE.layer_params()


def test_megatron_tensor_parallel_and_distributed_optimizer_divide_the_state():
    base = ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.dtype=bfloat16",
            "trainer.n_gpus_per_node=8", "trainer.device=npu"]
    tp4 = trainer_memory(cfg(*base, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                             "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"), SHAPE, 2)
    tp1 = trainer_memory(cfg(*base), SHAPE, 8)
    assert tp4.parts["params"] < tp1.parts["params"] / 3.5
    dist = trainer_memory(cfg(*base, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                              "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"), SHAPE, 2)
    assert dist.parts["optimizer"] == pytest.approx(tp4.parts["optimizer"] / 2)


def test_grads_count_fully_only_when_micro_batches_accumulate():
    one = trainer_memory(cfg("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.strategy=torch",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                             "data.train_batch_size=4"), SHAPE, 1)
    assert one.parts["grads"] == max(0.0, 2 * P - one.parts["activations"] - one.parts["logits"])
    many = trainer_memory(cfg("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.strategy=torch",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                              "data.train_batch_size=4"), SHAPE, 1)
    assert many.parts["grads"] == 2 * P


def test_checkpointing_and_the_fused_head_shrink_activations():
    full, logits = activation_bytes(SHAPE, 16384, 2, checkpointing=False, fused_head=False)
    ckpt, fused = activation_bytes(SHAPE, 16384, 2, checkpointing=True, fused_head=True)
    assert ckpt < full / 5
    assert logits == 2 * 4 * 16384 * SHAPE.vocab and fused < logits / 10


def test_compiled_layers_save_less_without_checkpointing_and_the_same_with_it():
    eager, _ = activation_bytes(SHAPE, 16384, 2, checkpointing=False, fused_head=True)
    compiled, _ = activation_bytes(SHAPE, 16384, 2, checkpointing=False, fused_head=True, compiled=True)
    # inductor recomputes the SwiGLU activation (I) and drops both norms' float32 input copies (2h x 4 bytes)
    assert eager - compiled == SHAPE.layers * 16384 * (SHAPE.intermediate * 2 + 2 * 4 * SHAPE.hidden)
    assert activation_bytes(SHAPE, 16384, 2, checkpointing=True, fused_head=True, compiled=True) == \
        activation_bytes(SHAPE, 16384, 2, checkpointing=True, fused_head=True)


@pytest.mark.parametrize("device, strategy, compiled", [("cuda", "fsdp", True), ("cuda", "fsdp2", True),
                                                        ("cuda", "megatron", False), ("npu", "fsdp", False),
                                                        ("cpu", "fsdp", False)])
def test_the_trainer_counts_compiled_layers_where_it_compiles_them(device, strategy, compiled):
    """torch_backend.compile_decoder_layers: inductor on CUDA only, and only in the torch/fsdp2 backends."""
    base = ["actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            f"trainer.device={device}", f"actor_rollout_ref.actor.strategy={strategy}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    on = trainer_memory(cfg(*base, "actor_rollout_ref.actor.use_torch_compile=true"), SHAPE, 1)
    off = trainer_memory(cfg(*base, "actor_rollout_ref.actor.use_torch_compile=false"), SHAPE, 1)
    assert (on.parts["activations"] < off.parts["activations"]) == compiled
    assert ("compiled layers" in on.note) == compiled


# measured on 1x H100 (scripts/check_memory_model.py, trainer row): the 0.5B-shaped model of
# scripts/build_shaped_model.py (vocabulary 64), one micro-batch of 16 x 528 tokens, bf16 params/grads/AdamW
MEASURED_05B = [("false", "true", 11.16), ("true", "true", 3.49), ("false", "false", 14.29)]


@pytest.mark.parametrize("ckpt, compile_, peak_gib", MEASURED_05B)
def test_the_trainer_estimate_is_within_ten_percent_of_the_measured_peak(ckpt, compile_, peak_gib):
    c = load_config(["actor_rollout_ref.model.path=Qwen2.5-0.5B", "trainer.device=cuda", "data.max_prompt_length=16",
                     "data.max_response_length=512", "actor_rollout_ref.actor.dtype=bfloat16",
                     "actor_rollout_ref.actor.strategy=torch",   # what the peaks were measured under
                     "actor_rollout_ref.actor.ppo_mini_batch_size=32", "data.train_batch_size=32",
                     "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                     f"actor_rollout_ref.model.enable_gradient_checkpointing={ckpt}",
                     f"actor_rollout_ref.actor.use_torch_compile={compile_}"])
    shape = Shape.of(dict(MODEL_SHAPES["Qwen2.5-0.5B"], vocab_size=64))
    assert trainer_memory(c, shape, 1).total / GIB == pytest.approx(peak_gib, rel=0.10)


def test_dynamic_batch_size_uses_the_token_budget():
    c = cfg("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192")
    assert "8192 tokens" in trainer_memory(c, SHAPE, 1).note


def test_engines():
    hf = engine_memory(cfg("actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.max_num_seqs=64"),
                       SHAPE, 64 * GIB)
    assert hf.parts["weights"] == 2 * P
    assert hf.parts["kv_cache"] == 64 * 4096 * SHAPE.kv_bytes_per_token(2)
    vllm = engine_memory(cfg("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                             "rollout.n_gpus_per_node=2"), SHAPE, 64 * GIB)
    assert vllm.total == pytest.approx(0.8 * 64 * GIB)
    assert vllm.parts["weights"] == P


def test_an_fp8_rollout_on_vllm_holds_its_linear_weights_in_one_byte(random_model_dir):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    shape = Shape.of(json.load(open(os.path.join(random_model_dir, "config.json"))))
    linear = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    assert shape.linear_weights() == linear
    base = ["actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"]
    fp8 = engine_memory(cfg(*base, "actor_rollout_ref.rollout.quantization=fp8"), SHAPE, 80 * GIB)
    lin = SHAPE.linear_weights()
    assert fp8.parts["weights"] == pytest.approx(2 * P - lin + lin * 4 / 128 ** 2)
    assert fp8.parts["weights"] < 0.6 * engine_memory(cfg(*base), SHAPE, 80 * GIB).parts["weights"]
    # the embedded engine emulates fp8: its weights stay in rollout.dtype
    emulated = engine_memory(cfg("actor_rollout_ref.rollout.dtype=bfloat16",
                                 "actor_rollout_ref.rollout.quantization=fp8"), SHAPE, 80 * GIB)
    assert emulated.parts["weights"] == 2 * P


def test_sync_colocation_and_offload():
    small = ["mode=sync", "actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    c = cfg(*small, "actor_rollout_ref.rollout.free_cache_engine=false")
    t, e = trainer_memory(c, SHAPE, 1), engine_memory(c, SHAPE, 64 * GIB)
    kept = colocated_memory(c, t, e)
    off = colocated_memory(cfg(*small, "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                               "actor_rollout_ref.rollout.free_cache_engine=true"), t, e)
    assert kept.total == pytest.approx(t.total + e.total)     # the engine stays resident while training
    assert off.total < kept.total
    assert off.total == pytest.approx(max(t.total, e.total + t.parts["gathered_layers"] if "gathered_layers" in
                                          t.parts else e.total))


def test_verdict():
    assert verdict(10, 100) == "fits"
    assert verdict(95, 100) == "tight"
    assert verdict(101, 100) == "does not fit"


def test_activation_bytes_match_saved_tensor_hooks_on_a_real_layer():
    """Count what autograd keeps for one and for three Qwen2 layers of the 0.5B shape (bf16, sdpa, CPU):
    the per-layer difference is the formula's per-layer term, with and without checkpointing."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def saved(layers, ckpt):
        cfg = Qwen2Config(vocab_size=64, hidden_size=896, num_hidden_layers=layers, num_attention_heads=14,
                          num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                          attn_implementation="sdpa")
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        if ckpt:
            m.gradient_checkpointing_enable()
            m.train()
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(torch.randint(0, 64, (2, 64)), use_cache=False)
        return sum(seen.values())

    shape = Shape.of(dict(MODEL_SHAPES["Qwen2.5-0.5B"], vocab_size=64))
    tokens = 128
    full, _ = activation_bytes(shape, tokens, 2, checkpointing=False, fused_head=True, layers=1)
    ckpt_two, _ = activation_bytes(shape, tokens, 2, checkpointing=True, fused_head=True, layers=2)
    ckpt_one, _ = activation_bytes(shape, tokens, 2, checkpointing=True, fused_head=True, layers=1)
    per_layer = (saved(3, False) - saved(1, False)) / 2
    assert full == pytest.approx(per_layer, rel=0.01)
    assert ckpt_two - ckpt_one == pytest.approx((saved(3, True) - saved(1, True)) / 2, rel=0.01)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU code generator needs a C++ compiler")
def test_compiled_activation_bytes_match_saved_tensor_hooks_on_an_inductor_layer():
    """The compiled term against what torch.compile(inductor)'s partitioner keeps for one Qwen2 layer of the 0.5B
    shape (bf16, sdpa, CPU; the partitioner is CUDA's): per layer, the 3-layer minus the 1-layer count."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
    from measure_saved_activations import saved_bytes

    shape = Shape.of(dict(MODEL_SHAPES["Qwen2.5-0.5B"], vocab_size=64))
    tokens = 128
    compiled, _ = activation_bytes(shape, tokens, 2, checkpointing=False, fused_head=True, layers=1, compiled=True)
    one, _ = saved_bytes(1, True, False, 2, 64, "bfloat16", 64)
    three, _ = saved_bytes(3, True, False, 2, 64, "bfloat16", 64)
    assert compiled == pytest.approx((three - one) / 2, rel=0.01)


def test_the_fused_head_chunk_is_the_trainers():
    """The planner's chunk per device is what train/backends/token_stats.py uses."""
    from fully_async.planner import memory_model
    from fully_async.train.backends import token_stats

    assert memory_model.DEVICE_CHUNK_ELEMS == token_stats.DEVICE_CHUNK_ELEMS
    assert memory_model.EAGER_CHUNK_ELEMS == token_stats.EAGER_CHUNK_ELEMS


def test_a_critic_adds_its_sharded_state_but_not_a_second_set_of_activations():
    """algorithm.adv_estimator=gae: the value model's params, grads and AdamW moments beside the actor's (Qwen2.5-7B
    has an untied lm_head, which the value model lacks); the actor's activations and logits stay the peak's."""
    base = ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.dtype=bfloat16"]
    plain = trainer_memory(cfg(*base), SHAPE, 8)
    gae = trainer_memory(cfg(*base, "algorithm.adv_estimator=gae"), SHAPE, 8)
    pc = P - SHAPE.vocab * SHAPE.hidden
    assert gae.parts["critic_params"] + gae.parts["critic_grads"] + gae.parts["critic_optimizer"] == \
        pytest.approx(16 * pc / 8)
    assert gae.total - plain.total == pytest.approx(16 * pc / 8)
    # while the engine generates, the critic's state stays resident as the actor's does (offloaded alike)
    parts = {"params": 1.0, "grads": 1.0, "optimizer": 2.0, "critic_params": 1.0, "critic_grads": 1.0,
             "critic_optimizer": 2.0, "activations": 1.0}
    trainer = RoleMemory("trainer", parts, strategy="fsdp2")
    engine = RoleMemory("engine", {"weights": 50.0})
    kept = colocated_memory(cfg(*base, "algorithm.adv_estimator=gae",
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"), trainer, engine)
    assert kept.note.startswith("peak while generating")
    assert "trainer.critic_params" in kept.parts and "trainer.critic_optimizer" not in kept.parts


def test_a_megatron_critic_and_reward_model_are_counted_in_the_actors_layout():
    base = ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.dtype=bfloat16",
            "trainer.n_gpus_per_node=2", "trainer.device=npu",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    grpo = trainer_memory(cfg(*base), SHAPE, 1)
    gae = trainer_memory(cfg(*base, "algorithm.adv_estimator=gae", "critic.strategy=megatron"), SHAPE, 1)
    trunk = gae.parts["critic_params"] / 2            # bf16 params: the trunk's stage per tensor rank
    assert 0 < trunk <= grpo.parts["params"] / 2
    assert gae.parts["critic_grads"] == pytest.approx(4 * trunk) and gae.parts["critic_optimizer"] == pytest.approx(
        12 * trunk)
    rm = trainer_memory(cfg(*base, "reward_model.enable=true", "reward_model.model.path=/rm"), SHAPE, 1)
    assert rm.parts["rm_params"] == pytest.approx(grpo.parts["params"])


SEED_003 = ["actor_rollout_ref.model.path=Qwen2.5-0.5B", "data.max_prompt_length=16", "data.max_response_length=3072",
            "actor_rollout_ref.rollout.dtype=bfloat16", "trainer.device=cuda", "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.max_num_seqs=null"]   # unset (the bundled task's preset sets 128)


def test_unset_max_num_seqs_gives_the_embedded_engine_the_responses_it_may_run_where_the_device_holds_them():
    from fully_async.planner.memory_model import AUTO_MAX_NUM_SEQS, engine_slots

    shape = Shape.of(MODEL_SHAPES["Qwen2.5-0.5B"])
    at = ["async_training.staleness_threshold=0.2", "async_training.trigger_parameter_sync_step=4"]
    packed = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768"]
    colocated = load_config([*SEED_003, "mode=async", "async_training.placement=colocated",
                             "rollout.n_gpus_per_node=0", *at, *packed])
    slots, why = engine_slots(colocated, shape, 141 * GIB)
    # async: the groups the staleness bound lets a version admit (64 x 1.2 x 4 = 307) x 8, capped at 1024
    assert slots == AUTO_MAX_NUM_SEQS == 1024 and "the 2456 responses of the 307 groups" in why, why
    assert "beside the trainer" not in why      # the packed trainer's estimate leaves room for them
    # beside a trainer that leaves no room (padded micro-batches: its estimate is most of the device), an engine on
    # its device keeps one step's 64 x 8 rather than turn recompute on or be freed at each switch; alone, it grows
    padded = load_config([*SEED_003, "mode=async", "async_training.placement=colocated",
                          "rollout.n_gpus_per_node=0", *at])
    slots, why = engine_slots(padded, shape, 141 * GIB)
    assert slots == 512 and "0 beside the trainer's estimated peak (one step's 512 at least)" in why, why
    split = load_config([*SEED_003, "mode=async", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1", *at])
    assert engine_slots(split, shape, 141 * GIB)[0] == 1024
    # no room to run ahead (threshold 0, an update every step): one step's 64 x 8, as sync
    tight = load_config([*SEED_003, "mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0",
                         "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"])
    assert engine_slots(tight, shape, 141 * GIB)[0] == 512
    # what the memory model then counts is that many slots, within gpu_memory_utilization of the device
    mem = engine_memory(colocated, shape, 141 * GIB)
    assert mem.parts["kv_cache"] == 1024 * 3088 * shape.kv_bytes_per_token(2)
    assert mem.total <= 0.5 * 141 * GIB
    # a device that holds fewer keeps verl's 256 (checked against the whole device, as a size that is set)
    assert engine_slots(colocated, shape, 16 * GIB)[0] == 256
    # in between: as many as fit in gpu_memory_utilization of it
    fit = engine_slots(colocated, shape, 30 * GIB)
    assert 256 < fit[0] < 512 and engine_memory(colocated, shape, 30 * GIB).total <= 0.5 * 30 * GIB
    # sync runs one step's responses at once: 512 on one engine, two engines share them; a larger step is capped
    one = engine_slots(load_config([*SEED_003, "mode=sync"]), shape, 141 * GIB)
    assert one[0] == 512 and "one step's 512 responses over 1 engine(s)" in one[1]
    sync = load_config([*SEED_003, "mode=sync", "trainer.n_gpus_per_node=2"])
    assert engine_slots(sync, shape, 141 * GIB)[0] == 256
    big = load_config([*SEED_003, "mode=sync", "data.train_batch_size=512"])
    assert engine_slots(big, shape, 141 * GIB)[0] == AUTO_MAX_NUM_SEQS
    # vLLM pages its KV cache and the cpu gains nothing from more slots: verl's default; graphs asked for get slots
    assert engine_slots(load_config([*SEED_003, "actor_rollout_ref.rollout.name=vllm"]), shape, 141 * GIB)[0] == 256
    assert engine_slots(load_config([*SEED_003, "trainer.device=cpu"]), shape, 141 * GIB)[0] == 256
    graphs = load_config([*SEED_003, "actor_rollout_ref.rollout.cudagraph_capture_sizes=[8,600]"])
    assert engine_slots(graphs, shape, 16 * GIB)[0] == 600
    # a size that is set is what the memory model counts
    assert engine_memory(load_config([*SEED_003, "actor_rollout_ref.rollout.max_num_seqs=64"]), shape,
                         141 * GIB).parts["kv_cache"] == 64 * 3088 * shape.kv_bytes_per_token(2)


def test_the_embedded_engines_prefill_holds_its_longest_request():
    """One admission prefills at most max_num_batched_tokens tokens, a longer request alone: a prompt (sync), or where
    a weight update aborts the responses in flight (async's default partial rollout with pause_mode=abort) a prompt
    with its partial response, up to max_model_len - 1 (4,095 here), unless the engine splits it (packed, CUDA/NPU)."""
    per_token = (2 * SHAPE.hidden + 3 * SHAPE.intermediate) * 2
    base = ("actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.max_num_seqs=64")

    def prefill(*overrides):
        return engine_memory(cfg(*base, *overrides), SHAPE, 64 * GIB).parts["prefill"] / per_token

    assert prefill("mode=sync") == 8192                                           # 64 x 1024 prompt tokens, capped
    assert prefill("mode=sync", "actor_rollout_ref.rollout.max_num_batched_tokens=512") == 1024  # a prompt alone
    budget = "actor_rollout_ref.rollout.max_num_batched_tokens=2048"
    assert prefill("mode=async", budget) == 4095                                  # a resumed partial response alone
    assert prefill("mode=async", budget, "actor_rollout_ref.rollout.pause_mode=keep") == 2048
    assert prefill("mode=async", budget, "async_training.partial_rollout=false") == 2048
    # on CUDA or an NPU in 16-bit the engine prefills packed and splits a longer request over steps: the budget holds
    assert prefill("mode=async", budget, "trainer.device=cuda") == 2048
    assert prefill("mode=async", budget, "trainer.device=npu") == 2048
    assert prefill("mode=async", budget, "trainer.device=cuda", "actor_rollout_ref.rollout.enable_chunked_prefill=false",
                   "actor_rollout_ref.rollout.max_model_len=4096") == 4095


def test_unset_checkpointing_is_off_only_where_the_update_fits_without_it():
    """actor_rollout_ref.model.enable_gradient_checkpointing unset: off where the trainer's peak without it (and the
    engine's memory, on a device they share) is at most RECOMPUTE_SHARE of the device; on where the device's memory
    is unknown (verl's default) or it does not fit; set, as set."""
    from fully_async.planner.memory_model import RECOMPUTE_SHARE, checkpoints_activations, engine_memory

    base = ("actor_rollout_ref.actor.dtype=bfloat16", "trainer.device=cuda",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=2048",
            "actor_rollout_ref.model.enable_gradient_checkpointing=null")   # over the bundled preset's false
    split = cfg(*base)                                                      # async, split: a trainer-only device
    off = trainer_memory(split, SHAPE, 1, checkpointing=False).total
    on = trainer_memory(split, SHAPE, 1, checkpointing=True).total
    assert on < off
    assert checkpoints_activations(split, SHAPE, 1, None)                   # unknown capacity: verl's default
    fits = off / RECOMPUTE_SHARE
    assert not checkpoints_activations(split, SHAPE, 1, fits * 1.01)
    assert checkpoints_activations(split, SHAPE, 1, fits * 0.99)
    assert trainer_memory(split, SHAPE, 1, fits * 1.01).parts["activations"] == \
        trainer_memory(split, SHAPE, 1, checkpointing=False).parts["activations"]
    # set: as set, whatever the device
    assert checkpoints_activations(cfg(*base, "actor_rollout_ref.model.enable_gradient_checkpointing=true"),
                                   SHAPE, 1, 1e15)
    assert not checkpoints_activations(cfg(*base, "actor_rollout_ref.model.enable_gradient_checkpointing=false"),
                                       SHAPE, 1, 1.0)
    # colocated: the engine's memory stays beside the trainer, so the same device may not fit both
    colo = cfg(*base, "async_training.placement=colocated", "rollout.n_gpus_per_node=0")
    engine = engine_memory(colo, SHAPE, fits * 1.01).total
    assert checkpoints_activations(colo, SHAPE, 1, fits * 1.01) == (off + engine > RECOMPUTE_SHARE * fits * 1.01)
    assert not checkpoints_activations(colo, SHAPE, 1, 10 * (off + engine))
