"""scripts/bench_decode_mlp.py: its baseline is the engine's two-kernel MLP half (the reference's math), and a tile
is picked only where it beats that baseline by the margin."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from bench_decode_mlp import baseline, pick  # noqa: E402
from fully_async.rollout.engines.decode_mlp import reference_swiglu_matmul  # noqa: E402


def test_the_baseline_computes_the_reference():
    x, w = torch.randn(3, 1, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    assert torch.allclose(baseline(x, w), reference_swiglu_matmul(x, w))


def test_a_tile_is_picked_only_past_the_margin():
    timed = [{"tile": [64, 64, 64, 4, 3], "us": 9.0}, {"tile": [16, 64, 128, 4, 4], "us": 9.6}]
    assert pick(timed, 10.0, 0.03) == (timed[0], [64, 64, 64, 4, 3])
    assert pick(timed, 9.2, 0.03) == (timed[0], None)          # 2% faster: cuBLAS stays
    assert pick([], 9.2, 0.03) == (None, None)
