"""verl's blockwise fp8 rollout arithmetic (core/fp8.py) against torch's float8_e4m3fn cast and vLLM's formulas."""
import pytest
import torch

from fully_async.core.fp8 import (E4M3_MAX, Fp8Emulation, fake_quant_activation, fake_quant_weight, fp8_linears,
                                  quantize_weight, round_e4m3)

FP8 = torch.float8_e4m3fn


def e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return v[torch.isfinite(v)].unique()


def test_round_e4m3_is_the_cast_on_every_value_tie_and_neighbour():
    v = e4m3_values()
    assert len(v) == 253 and v.max() == E4M3_MAX   # 126 magnitudes each sign, one zero
    mids = (v[1:] + v[:-1]) / 2                    # exact ties: to even, as the cast
    eps = 1e-5 * mids.abs().clamp(min=1e-3)
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(20000, generator=g) * s for s in (300.0, 1.0, 1e-2, 1e-3)]).clamp(-448, 448)
    x = torch.cat([v, mids, mids + eps, mids - eps, rand])
    assert torch.equal(round_e4m3(x), x.to(FP8).float())


def vllm_weight_reference(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """vLLM's per_block_cast_to_fp8 (utils/deep_gemm.py) with torch's fp8 cast, dequantised."""
    m, n = w.shape
    pm, pn = -(-m // block) * block, -(-n // block) * block
    padded = torch.zeros(pm, pn, dtype=w.dtype)
    padded[:m, :n] = w
    view = padded.view(-1, block, pn // block, block)
    sf = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    q = (view * (1.0 / sf)).to(FP8)
    return (q.float() * sf).view(pm, pn)[:m, :n]


def vllm_activation_reference(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """vLLM's per_token_group_quant_fp8 (its triton kernel's arithmetic) with torch's cast, dequantised."""
    g = x.float().view(-1, x.shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) * (1.0 / 448.0)
    return ((g / s).clamp(-448, 448).to(FP8).float() * s).view(x.shape)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (64, 128), (1, 5)])
def test_weight_blocks_match_vllms_per_block_cast(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    q, scale = quantize_weight(w)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(q.to(FP8).float(), q)       # every value is an e4m3 value
    assert q.abs().max() == E4M3_MAX                # the largest of a block lands on the top of the range
    assert torch.equal(fake_quant_weight(w), vllm_weight_reference(w))
    assert torch.equal(fake_quant_weight(fake_quant_weight(w)), fake_quant_weight(w))   # a re-load is idempotent
    assert 0 < (fake_quant_weight(w) - w).abs().max() <= w.abs().max() / 16   # 3 mantissa bits


def test_each_block_has_its_own_scale():
    w = torch.ones(256, 256)
    w[:128, 128:] *= 1000.0
    q, scale = quantize_weight(w)
    assert torch.allclose(scale, torch.tensor([[1.0, 1000.0], [1.0, 1.0]]) / 448)
    assert torch.equal(fake_quant_weight(w), w)     # a block of one value is exact


def test_activation_groups_match_vllms_per_token_group_quant():
    x = torch.randn(3, 7, 384, generator=torch.Generator().manual_seed(2)) * 4
    x[0, 0, :128] *= 1e4                             # one group's scale does not touch its neighbours
    got = fake_quant_activation(x)
    assert torch.equal(got, vllm_activation_reference(x))
    assert torch.equal(got[0, 0, 128:], vllm_activation_reference(x[0, 0, 128:].clone()))
    bf = x.to(torch.bfloat16)
    assert fake_quant_activation(bf).dtype == torch.bfloat16
    assert torch.equal(fake_quant_activation(torch.zeros(2, 128)), torch.zeros(2, 128))
    # a partial last group (64 features) is a group of its own
    y = torch.randn(5, 192)
    assert torch.equal(fake_quant_activation(y)[:, 128:], vllm_activation_reference(
        torch.nn.functional.pad(y[:, 128:], (0, 64))).view(5, 128)[:, :64])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 128)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(128, 256), torch.nn.Linear(256, 128, bias=False)])
        self.head = torch.nn.Linear(128, 10, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def test_emulation_quantises_the_decoders_linears_and_their_inputs_only():
    torch.manual_seed(0)
    model = Tiny()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    emu = Fp8Emulation(model, model.layers)
    assert sorted(emu.linears) == ["layers.0.weight", "layers.1.weight"]
    for name in ("embed.weight", "head.weight", "layers.0.bias"):
        assert torch.equal(dict(model.named_parameters())[name], original[name])
    for name in emu.linears:
        assert torch.equal(dict(model.named_parameters())[name], fake_quant_weight(original[name]))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        h = model.embed(ids)
        l0, l1 = model.layers
        h = torch.relu(torch.nn.functional.linear(fake_quant_activation(h), l0.weight, l0.bias))
        h = torch.relu(torch.nn.functional.linear(fake_quant_activation(h), l1.weight))
        assert torch.equal(model(ids), model.head(h))
    with torch.no_grad():   # a load of new weights, then requantize() of those named
        model.layers[1].weight.copy_(original["layers.1.weight"] * 2)
    assert emu.requantize(["layers.1.weight", "head.weight", "layers.0.bias"]) == 1
    assert torch.equal(model.layers[1].weight, fake_quant_weight(original["layers.1.weight"] * 2))
    emu.remove()
    with torch.no_grad():
        assert not torch.equal(model(ids), model.head(h))


def test_fused_expert_tensors_are_refused_by_name():
    model = Tiny()
    model.layers[0].experts = torch.nn.Parameter(torch.zeros(4, 8, 8))
    with pytest.raises(ValueError, match=r"layers\.0\.experts \(4, 8, 8\) is a fused expert tensor.*"
                                         r"rollout\.name=vllm"):
        fp8_linears(model, model.layers)
