"""strategy=megatron against the Hugging Face model on a real accelerator (skipped without one).

A small random Qwen2 (GQA, q/k/v bias, tied and untied) is loaded by TorchBackend and by
MegatronBackend (world size 1, tp 1): per-token log-probs agree, one PPO step agrees with the
torch backend's and changes the weights, and named_parameters_for_sync() returns the HF weights.
Builders come from scripts/gpu_megatron_check.py (the same check at the 0.5B shape).
"""
import importlib.util
import os

import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if not DEVICE.is_accelerator:
    pytest.skip("needs a CUDA or NPU device: megatron-core's forward does not run on CPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install fully_async[megatron])")

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "scripts", "gpu_megatron_check.py")
_spec = importlib.util.spec_from_file_location("gpu_megatron_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=512, vocab_size=2048, max_position_embeddings=512)
TOL = {"float32": 1e-3, "bfloat16": 0.05}   # max |log-prob difference| over all real tokens


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    import torch.distributed as dist

    if not dist.is_initialized():
        DEVICE.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group(DEVICE.comm_backend, rank=0, world_size=1)
    yield


@pytest.fixture(scope="module", params=[("float32", False), ("bfloat16", True)], ids=["fp32-untied", "bf16-tied"])
def pair(request, tmp_path_factory):
    from fully_async.backends.megatron_backend import MegatronBackend
    from fully_async.backends.torch_backend import TorchBackend
    from fully_async.device import parse_dtype

    dtype, tied = request.param
    path = str(tmp_path_factory.mktemp(f"qwen2_{dtype}"))
    check.build_model(path, {**SHAPE, "tie_word_embeddings": tied}, parse_dtype(dtype))
    cfg = check.make_config(path, dtype, DEVICE.name)
    hf, mg = TorchBackend(cfg, DEVICE, 10), MegatronBackend(cfg, DEVICE, 10)
    batch = check.make_batch(6, 96, SHAPE["vocab_size"])
    valid = batch.attention_mask.bool().clone()
    valid[:, 0] = False
    yield dtype, path, hf, mg, batch, valid
    del hf, mg
    DEVICE.empty_cache()


def test_log_probs_match_hf(pair):
    dtype, _, hf, mg, batch, valid = pair
    stats = check.diff_stats(mg.compute_log_probs(batch), hf.compute_log_probs(batch), valid)
    assert stats["ref_std"] > 20 * TOL[dtype], "log-probs too flat for the comparison to mean anything"
    assert stats["max_abs"] < TOL[dtype], stats


def test_sync_returns_the_hf_weights(pair):
    from safetensors.torch import load_file

    _, path, _, mg, _, _ = pair
    original = load_file(os.path.join(path, "model.safetensors"))
    synced = mg.named_parameters_for_sync()
    assert sorted(synced) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(synced[name], tensor), name


def test_train_step_matches_torch_backend_and_moves_weights(pair):
    dtype, _, hf, mg, batch, valid = pair
    batch.old_log_probs = hf.compute_log_probs(batch)
    before = mg.named_parameters_for_sync()
    m_hf = hf.train_step(batch, num_mini_batches=2)
    m_mg = mg.train_step(batch, num_mini_batches=2)
    assert all(torch.isfinite(torch.tensor(v)) for v in m_mg.values()), m_mg
    assert m_mg["actor/bad_steps"] == 0.0
    rel = 1e-3 if dtype == "float32" else 5e-2
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy"):
        assert m_mg[key] == pytest.approx(m_hf[key], rel=rel, abs=rel * 1e-2), key
    assert m_mg["actor/lr"] == pytest.approx(m_hf["actor/lr"])
    after = mg.named_parameters_for_sync()
    assert max(float((after[k].float() - before[k].float()).abs().max()) for k in before) > 0
    # the synced weights, loaded into the HF model, give megatron's log-probs
    hf.model.load_state_dict(after, strict=False)
    stats = check.diff_stats(mg.compute_log_probs(batch), hf.compute_log_probs(batch), valid)
    assert stats["max_abs"] < TOL[dtype], stats


def test_offload_onload_and_checkpoint_round_trip(pair, tmp_path):
    _, _, _, mg, batch, valid = pair
    reference = mg.compute_log_probs(batch)
    mg.offload()
    mg.onload()
    assert torch.equal(mg.compute_log_probs(batch), reference)
    batch.old_log_probs = reference
    mg.train_step(batch, num_mini_batches=1)          # optimizer state exists before saving
    saved = mg.compute_log_probs(batch)
    mg.save(str(tmp_path))
    mg.train_step(batch, num_mini_batches=1)
    assert not torch.equal(mg.compute_log_probs(batch), saved)
    mg.load(str(tmp_path))
    assert torch.equal(mg.compute_log_probs(batch), saved)
