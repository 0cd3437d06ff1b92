"""PPO's critic on strategy=megatron (train/backends/megatron_critic.py) against the torch critic on a real
accelerator (skipped without one), float32, world of one: the same values from the same weights, the same critic
update (loss, grad norm, new values), offload/onload, and a checkpoint whose critic/ folder is a Hugging Face
ForTokenClassification model giving the same values."""
import importlib.util
import os

import pytest
import torch

from fully_async.device import get_device
from fully_async.train.ppo_update import critic_update

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
TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    import torch.distributed as dist

    if not dist.is_initialized():
        DEVICE.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29513")
        dist.init_process_group(DEVICE.comm_backend, rank=0, world_size=1)
    yield


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, tmp_path_factory):
    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.backends.torch_backend import TorchBackend

    path = str(tmp_path_factory.mktemp("qwen2_critic"))
    check.build_model(path, {**SHAPE, "tie_word_embeddings": request.param}, torch.float32)
    cfg = check.make_config(path, "float32", DEVICE.name, extra={
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "critic.optim.lr_warmup_steps": 0,
        "critic.ppo_micro_batch_size_per_gpu": 2, "critic.forward_micro_batch_size_per_gpu": 4,
        "critic.ppo_mini_batch_size": 3, "critic.cliprange_value": 0.5})
    hf, mg = TorchBackend(cfg, DEVICE, 10), MegatronBackend(cfg, DEVICE, 10)
    head = mg.critic.model.module.output_layer.linear
    with torch.no_grad():                         # the same (newly initialised) value head on both
        hf.critic.model.score.weight.copy_(head.weight)
        if hf.critic.model.score.bias is not None:
            hf.critic.model.score.bias.copy_(head.bias)
        else:
            head.bias.zero_()
    batch = check.make_batch(6, 96, SHAPE["vocab_size"])
    yield cfg, hf, mg, batch
    del hf, mg
    DEVICE.empty_cache()


def max_diff(a, b, mask):
    return float((a - b).abs()[mask.bool()].max())


def test_values_match_the_torch_critic(pair):
    _, hf, mg, batch = pair
    v_mg, v_hf = mg.compute_values(batch), hf.compute_values(batch)
    assert (v_mg[batch.response_mask == 0] == 0).all()
    assert float(v_hf[batch.response_mask.bool()].std()) > 20 * TOL, "values too flat to compare"
    assert max_diff(v_mg, v_hf, batch.response_mask) < TOL


def test_critic_update_matches_the_torch_critic(pair):
    cfg, hf, mg, batch = pair
    batch.values = hf.compute_values(batch)
    g = torch.Generator().manual_seed(3)
    batch.returns = (batch.values + torch.randn(batch.values.shape, generator=g)) * batch.response_mask
    for _ in range(2):
        m_hf = critic_update(hf, cfg, batch, num_mini_batches=2)
        m_mg = critic_update(mg, cfg, batch, num_mini_batches=2)
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"):
            assert m_mg[key] == pytest.approx(m_hf[key], rel=2e-3, abs=1e-5), (key, m_hf, m_mg)
        assert m_mg["critic/lr"] == pytest.approx(m_hf["critic/lr"])
    assert max_diff(mg.compute_values(batch), hf.compute_values(batch), batch.response_mask) < 10 * TOL
    assert max_diff(mg.compute_values(batch), batch.values, batch.response_mask) > 10 * TOL   # it moved


def test_offload_checkpoint_and_a_hugging_face_critic_folder(pair, tmp_path):
    from transformers import AutoModelForTokenClassification

    cfg, _, mg, batch = pair
    reference = mg.compute_values(batch)
    mg.offload()
    mg.onload()
    assert torch.equal(mg.compute_values(batch), reference)
    batch.values = reference
    batch.returns = reference + batch.response_mask
    critic_update(mg, cfg, batch, num_mini_batches=1)          # optimizer state exists before saving
    saved = mg.compute_values(batch)
    mg.save(str(tmp_path))
    critic_update(mg, cfg, batch, num_mini_batches=1)
    assert not torch.equal(mg.compute_values(batch), saved)
    mg.load(str(tmp_path))
    assert torch.equal(mg.compute_values(batch), saved)
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32)
    model.to(DEVICE.torch_device()).eval()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids.to(DEVICE.torch_device()),
                    attention_mask=batch.attention_mask.to(DEVICE.torch_device())).logits[..., 0].float().cpu()
    from_hf = torch.nn.functional.pad(out[:, :-1], (1, 0)) * batch.response_mask
    assert max_diff(from_hf, saved, batch.response_mask) < TOL
