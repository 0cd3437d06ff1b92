"""Whether the rollout engine fits its device, checked before it allocates (layer 4).

Why: the embedded engine preallocates its whole slot KV cache (max_num_seqs x max_model_len x layers x kv heads x
head_dim x dtype bytes x 2, keys and values) and vLLM takes gpu_memory_utilization of the device at start-up.  A
size that cannot fit otherwise ends in an out-of-memory error deep in an allocation (or in the host's OOM killer on
cpu), naming no key.  `check_engine_fit` compares the engine's weights and cache with the room of its device (on cpu
the host's RAM), as the model's config.json gives its shape, and refuses a size that cannot fit with a ConfigError
naming actor_rollout_ref.rollout.max_num_seqs / max_model_len / gpu_memory_utilization and what would fit.  It only
refuses the certainly impossible: other buffers (prefill activations, decode graphs) come on top.

Devices shared in time (a shared pool, colocated or elastic placement: the trainer's memory leaves when the engine's
turn comes) are compared with the device's total, not with what is free while the engine is built.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from fully_async.core.config import ConfigError, num_seqs

logger = logging.getLogger(__name__)

GIB = float(2**30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KEY = "actor_rollout_ref.rollout"


@dataclass
class EngineSize:
    """One engine device's share (bytes): weights, KV cache, float32 logits of every slot."""

    weights: float
    kv_per_token: float     # keys and values of one token over every layer: 2 x layers x kv heads x head_dim x bytes
    vocab: int
    formula: str

    def kv(self, seqs: int, length: int) -> float:
        return seqs * length * self.kv_per_token

    def need(self, seqs: int, length: int) -> float:
        return self.weights + self.kv(seqs, length) + 4.0 * seqs * self.vocab


def model_config(cfg: Any) -> Optional[dict]:
    """The model's config.json (a local folder's, else transformers' for a Hub name); None when unreadable."""
    model = cfg.actor_rollout_ref.model
    path = os.path.join(str(model.path), "config.json")
    try:
        if os.path.isfile(path):
            with open(path) as fh:
                config = json.load(fh)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code).to_dict()
    except Exception as exc:  # noqa: BLE001 - the engine's own load reports a model it cannot read
        logger.debug("engine fit not checked: the model's config is unreadable (%s)", exc)
        return None
    return config.get("text_config", config) if "hidden_size" not in config else config


def engine_size(cfg: Any, config: dict) -> Optional[EngineSize]:
    from fully_async.planner.hardware import Shape

    r = cfg.actor_rollout_ref.rollout
    wbytes = DTYPE_BYTES.get(r.dtype)
    try:
        shape = Shape.of(config)
    except ValueError as exc:   # a shape the memory model does not size (mixture of experts, ...)
        logger.debug("engine fit not checked: %s", exc)
        return None
    if wbytes is None:
        return None
    tp = max(1, int(r.tensor_model_parallel_size))
    formula = (f"{shape.layers} layers x {shape.kv_heads} kv heads x {shape.head_dim} head_dim x {wbytes} bytes x 2"
               + (f" / tensor_model_parallel_size={tp}" if tp > 1 else ""))
    return EngineSize(shape.params() * wbytes / tp, shape.kv_bytes_per_token(wbytes) / tp, shape.vocab, formula)


def shared_in_time(cfg: Any) -> bool:
    placement = getattr(getattr(cfg, "async_training", None), "placement", "split")
    return cfg.multi_job.pool is not None or (cfg.mode == "async" and placement in ("colocated", "elastic"))


def check_engine_fit(cfg: Any, device: Any, config: Optional[dict] = None,
                     room: Optional[tuple[float, float]] = None) -> None:
    """Refuse an engine size that cannot fit `device` (ConfigError naming the key and what would fit).  `config`:
    the model's config.json (read when not given); `room`: (bytes free to this process, the device's total)."""
    r = cfg.actor_rollout_ref.rollout
    if r.name not in ("hf", "vllm") or (r.name == "vllm" and not device.is_accelerator):
        return   # a user engine sizes itself; vLLM on cpu takes VLLM_CPU_KVCACHE_SPACE, not a device fraction
    config = config if config is not None else model_config(cfg)
    size = engine_size(cfg, config) if config is not None else None
    if size is None:
        return
    free, total = room if room is not None else device.memory_room()
    length = int(r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length)
    where = "the host's RAM" if not device.is_accelerator else f"one {device.name} device"
    if r.name == "vllm":
        _check_vllm(r, size, free, total, length, where, shared_in_time(cfg))
        return
    limit = total if shared_in_time(cfg) else free
    seqs = num_seqs(r)
    need = size.need(seqs, length)
    if need <= limit:
        return
    what = (f"its total {limit / GIB:.2f} GiB (the devices are shared in time)" if shared_in_time(cfg) else
            f"{limit / GIB:.2f} GiB free to it now")
    room_kv = limit - size.weights
    fit_seqs = max(0, math.floor(room_kv / (length * size.kv_per_token + 4.0 * size.vocab)))
    fit_len = max(0, math.floor((room_kv - 4.0 * seqs * size.vocab) / (seqs * size.kv_per_token)))
    if fit_seqs >= 1:
        fits = (f"what fits: {KEY}.max_num_seqs <= {fit_seqs} at max_model_len={length}, or {KEY}.max_model_len <= "
                f"{fit_len} at max_num_seqs={seqs}" if fit_len >= 1 else
                f"what fits: {KEY}.max_num_seqs <= {fit_seqs} at max_model_len={length}")
    else:
        fits = ("not even one sequence of max_model_len fits beside the weights: a shorter max_model_len, rollout "
                "tensor parallelism, a smaller model or a larger device")
    raise ConfigError(f"{KEY}.max_num_seqs", (
        f"the embedded engine needs {need / GIB:.2f} GiB on {where} but has {what}: weights "
        f"{size.weights / GIB:.2f} GiB + KV cache max_num_seqs={seqs} x max_model_len={length} x {size.formula} = "
        f"{size.kv(seqs, length) / GIB:.2f} GiB + logits {4.0 * seqs * size.vocab / GIB:.2f} GiB; {fits} "
        f"({KEY}.gpu_memory_utilization does not size the embedded engine)"))


def _check_vllm(r: Any, size: EngineSize, free: float, total: float, length: int, where: str, shared: bool) -> None:
    util = float(r.gpu_memory_utilization)
    reserve = util * total
    key = f"{KEY}.gpu_memory_utilization"
    if not shared and reserve > free:
        raise ConfigError(key, f"vLLM takes {util:g} of {where}'s {total / GIB:.2f} GiB = {reserve / GIB:.2f} GiB at "
                          f"start-up, but {free / GIB:.2f} GiB is free to it; what fits: gpu_memory_utilization <= "
                          f"{math.floor(free / total * 100) / 100:.2f}")
    one = length * size.kv_per_token
    if reserve - size.weights < one:
        wanted = math.ceil((size.weights + one) / total * 100) / 100
        fit_len = max(0, math.floor((reserve - size.weights) / size.kv_per_token))
        raise ConfigError(f"{KEY}.max_model_len", (
            f"vLLM's share of {where} (gpu_memory_utilization={util:g} x {total / GIB:.2f} GiB = "
            f"{reserve / GIB:.2f} GiB) less its weights ({size.weights / GIB:.2f} GiB) holds no sequence of "
            f"max_model_len={length} ({one / GIB:.3f} GiB of KV: {size.formula}); what fits: {key} >= {wanted:.2f}"
            + (f", or max_model_len <= {fit_len}" if fit_len >= 1 else "")))
