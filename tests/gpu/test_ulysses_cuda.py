"""Ulysses sequence parallelism on two CUDA devices over NCCL (skipped with fewer): a trainer of 2 ranks at
ulysses_sequence_parallel_size=2 computes the log-probs, values, updates and weights of one device (float32, the
per-sequence attention), and the bf16 packed path (torch's FlashAttention varlen kernel on each rank's heads) stays
within bf16 tolerance of one device."""
import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda" or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices: Ulysses over NCCL", allow_module_level=True)

from ulysses_parity import check_parity  # noqa: E402


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# rank 0 is this process on GPU 0; rank 1 a Ray actor pinned to GPU 1 (no Ray GPU resource, as a pool pins ranks)
RANK1 = {"num_cpus": 1, "runtime_env": {"env_vars": DEVICE.pinned_env([1])}}


def test_two_gpus_at_sequence_parallel_2_match_one_gpu_float32(ray_gpus):
    check_parity(DEVICE, 2, RANK1, ["trainer.device=cuda"])


def test_two_gpus_at_sequence_parallel_2_match_one_gpu_bf16_flash(ray_gpus):
    check_parity(DEVICE, 2, RANK1, ["trainer.device=cuda", "actor_rollout_ref.actor.dtype=bfloat16"],
                 rel=0.1, atol=2e-2, mean=True)
    # 2x H200: log-probs 0.010 apart on average (bf16's step at ~3); after the first of two AdamW steps at lr 0.01
    # (every weight moves by ~lr, a near-zero gradient's by whichever sign bf16 rounding gave it) the second
    # mini-batch's kl_loss read 3.055 against one device's 2.871 (6%)

