"""scripts/bench_linear_shapes.py: a decoder layer's linear maps, separate and fused, hold the same weights."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from bench_linear_shapes import SHAPES, layer_maps  # noqa: E402


def test_the_fused_layer_holds_the_separate_layers_weights():
    for shape in SHAPES.values():
        separate, fused = layer_maps(shape, False), layer_maps(shape, True)
        assert [n for n, _, _ in separate] == ["q", "k", "v", "o", "gate", "up", "down"]
        assert [n for n, _, _ in fused] == ["qkv", "o", "gate_up", "down"]
        assert sum(i * o for _, i, o in separate) == sum(i * o for _, i, o in fused)
    outputs = {name: n_out for name, _, n_out in layer_maps(SHAPES["0.5b"], False)}
    assert (outputs["k"], outputs["gate"], outputs["down"]) == (128, 4864, 896)      # Qwen2.5-0.5B's layer
