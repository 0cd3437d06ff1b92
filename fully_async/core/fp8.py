"""FP8 rollouts (actor_rollout_ref.rollout.quantization=fp8): verl's blockwise scheme, emulated exactly.

verl's fp8 rollout (and vLLM's `fp8_per_block`, which the vLLM engine uses for it) quantises every linear layer of
the decoder to float8 e4m3: weights in 128 x 128 blocks with one scale each (scale = block amax / 448), activations
dynamically per token in groups of 128 input features (scale = group amax / 448, at least 1e-10), and multiplies the
fp8 values with float32 accumulation; embeddings, norms and the LM head stay in the compute dtype.  The training
side is untouched: the mismatch between the fp8 behaviour policy and the trainer's is what rollout correction
(algorithm.rollout_correction) is for.

The embedded engine has no fp8 GEMMs, so it reproduces the arithmetic instead: each weight is replaced by its
dequantised fp8 value (block scale x e4m3 value) whenever weights are loaded, and each linear layer's input by its
dequantised per-token-group fp8 value; the matmul of the two is the fp8 product up to accumulation order.  The
rounding to e4m3 (`round_e4m3`) is done with float32 arithmetic rather than a cast to torch.float8_e4m3fn, so it
runs on every device (CPU, CUDA, NPU) with the same result as the cast (round to nearest even, tested against it).
It gives the fp8 rollout's numerics, not its speed or memory: the weights stay in the compute dtype.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

E4M3_MAX = 448.0
BLOCK = 128          # weight blocks are BLOCK x BLOCK; activation groups are 1 x BLOCK
ACT_EPS = 1e-10      # vLLM's per_token_group_quant_fp8
WEIGHT_EPS = 1e-4    # vLLM's per_block_cast_to_fp8
QUANTIZATIONS = (None, "fp8")


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The nearest float8 e4m3 value of each element of float32 `x` (ties to even), x within [-448, 448]: 3
    mantissa bits, normal exponents from -6, subnormals in steps of 2**-9."""
    _, exp = torch.frexp(x)                      # |x| = m * 2**exp, m in [0.5, 1): the binade is 2**(exp - 1)
    step = torch.ldexp(torch.ones_like(x), (exp - 4).clamp(min=-9))
    return (torch.round(x / step) * step).clamp(-E4M3_MAX, E4M3_MAX)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_weight(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as float32, scales of shape (ceil(out / block), ceil(in / block))) of a 2-D weight, one scale
    per block x block tile (a partial tile at the edges takes the amax of what it holds)."""
    out_f, in_f = weight.shape
    rb, cb = -(-out_f // block), -(-in_f // block)
    tiles = _pad_to(weight.float(), rb * block, cb * block).view(rb, block, cb, block)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=WEIGHT_EPS) / E4M3_MAX
    q = round_e4m3((tiles * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX))
    return q.view(rb * block, cb * block)[:out_f, :in_f], scale.view(rb, cb)


def fake_quant_weight(weight: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The weight the fp8 GEMM multiplies: its blockwise e4m3 values times their scales, in the weight's dtype."""
    q, scale = quantize_weight(weight, block)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:weight.shape[0], :weight.shape[1]]
    return (q * full).to(weight.dtype)


def fake_quant_activation(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """The activation the fp8 GEMM multiplies: per token (every leading index), groups of `group` features scaled
    by their amax / 448, rounded to e4m3 and scaled back, in x's dtype (a partial last group is its own group)."""
    features = x.shape[-1]
    groups = -(-features // group)
    flat = torch.nn.functional.pad(x.float(), (0, groups * group - features)).view(*x.shape[:-1], groups, group)
    scale = flat.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_EPS) * (1.0 / E4M3_MAX)
    q = round_e4m3((flat / scale).clamp(-E4M3_MAX, E4M3_MAX)) * scale
    return q.view(*x.shape[:-1], groups * group)[..., :features].to(x.dtype)


def fp8_linears(model: torch.nn.Module, decoder: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers an fp8 rollout quantises, by their weight's name in `model`: every nn.Linear inside the
    decoder stack (attention, MLP, the experts of a mixture-of-experts model whose experts are nn.Linear).  A
    decoder weight of 3 or more dims (experts fused into one tensor) is refused: its matmul is not an nn.Linear the
    emulation can reach."""
    decoder_ids = {id(m) for m in decoder.modules()}
    out = {}
    for name, module in model.named_modules():
        if id(module) not in decoder_ids:
            continue
        if isinstance(module, torch.nn.Linear):
            out[f"{name}.weight" if name else "weight"] = module
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() >= 3:
                raise ValueError(f"actor_rollout_ref.rollout.quantization=fp8: the embedded engine quantises "
                                 f"nn.Linear layers, and {name}.{pname} {tuple(param.shape)} is a fused expert "
                                 "tensor; use actor_rollout_ref.rollout.name=vllm (vLLM's fp8_per_block covers "
                                 "fused experts) or rollout.quantization=null")
    return out


class Fp8Emulation:
    """An fp8 rollout on a torch model (the embedded engine): `requantize()` replaces the linear weights by their
    fp8 values in place (after every load: the captured device graphs keep reading the same storage), and forward
    pre-hooks replace each linear layer's input by its fp8 value."""

    def __init__(self, model: torch.nn.Module, decoder: torch.nn.Module):
        self.linears = fp8_linears(model, decoder)
        if not self.linears:
            raise ValueError("actor_rollout_ref.rollout.quantization=fp8: the model's decoder has no nn.Linear "
                             "layers to quantise")
        self._hooks = [m.register_forward_pre_hook(_quantize_input) for m in self.linears.values()]
        self.requantize()

    def requantize(self, names: Optional[Iterable[str]] = None) -> int:
        """Round the weights named (every quantised one when None; names of other tensors are skipped) to their
        fp8 values; returns how many were."""
        chosen = self.linears if names is None else {n: self.linears[n] for n in names if n in self.linears}
        with torch.no_grad():
            for module in chosen.values():
                module.weight.copy_(fake_quant_weight(module.weight))
        return len(chosen)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _quantize_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (fake_quant_activation(args[0]),) + tuple(args[1:])
