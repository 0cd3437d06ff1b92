"""Embedded rollout engine: pure torch + transformers, continuous batching over a KV cache.

Why our own loop instead of `model.generate`: the async pipeline needs requests to join the
running batch as others finish, to be cut off mid-generation at a weight update with their
partial tokens and log-probs, and to stamp each token with the weights' version.  `generate`
does none of that.

Mechanics.  Running sequences share one left-padded KV cache: per layer keys/values of shape
(B, H, L, D) plus an attention mask (B, L) whose zeros mark padding.  Each `collect()` is one
engine iteration:
  1. admit waiting requests up to `max_num_seqs`: prefill them as a left-padded batch and
     splice their cache into the running one (pad both to the same length, concat on batch).
     While sequences are running, admission waits until `admit_batch` slots (max_num_seqs / 8) are
     free: each admission costs a prefill forward and a copy of the whole cache, which long-tail
     lengths and an engine pool refilling freed slots would otherwise pay at almost every step.
     (Measured: no visible change on the 2-core CPU default run, 13.5-14.0 s vs 13.9-15.5 s; the
     H200 runs in the README were taken with it);
  2. sample one token for every running sequence from its pending logits;
  3. retire the sequences that hit EOS or max_tokens (index-select them out of the cache);
  4. run one decode forward for the rest and trim cache columns that are padding in every row.
Positions come from the mask (number of real tokens so far), so left padding never shifts RoPE.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from fully_async.algorithms.sampling import sample_tokens
from fully_async.device import Device, parse_dtype
from fully_async.engines.base import NamedTensors
from fully_async.types import GenOutput, GenRequest

logger = logging.getLogger(__name__)


@dataclass
class _Seq:
    req: GenRequest
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def output(self, reason: str) -> GenOutput:
        return GenOutput(self.req.request_id, self.tokens, self.log_probs, self.versions, reason)


class HFEngine:
    def __init__(self, model_path: str, device: Device, dtype: str = "float32", max_num_seqs: int = 256,
                 eos_token_ids: Optional[list[int]] = None, pad_token_id: int = 0, seed: int = 1,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.torch_device = device.torch_device()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code).to(self.torch_device).eval()
        self.max_num_seqs = max_num_seqs
        self.admit_batch = max(1, max_num_seqs // 8)  # free slots that trigger an admission mid-run
        self.eos = set(eos_token_ids or [])
        self.pad_token_id = pad_token_id
        self.version = 0
        self.generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # per layer (B, H, L, D)
        self._mask: Optional[torch.Tensor] = None                            # (B, L) long
        self._next_logits: Optional[torch.Tensor] = None                     # (B, V)
        self._pending_tokens: Optional[torch.Tensor] = None                  # (B,) last sampled
        self._sleep_level = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ contract
    def submit(self, requests: list[GenRequest]) -> None:
        if self._sleep_level:
            raise RuntimeError("HFEngine.submit() while asleep: call wake_up() first")
        for req in requests:
            if not req.prompt_ids:
                raise ValueError(f"request {req.request_id} has an empty prompt")
            self.waiting.append(_Seq(req))

    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        """One engine iteration (admit, sample, retire, decode); `timeout_s` is not needed here."""
        if not self.running and not self.waiting:
            return []
        with torch.inference_mode():
            self._admit()
            finished = self._sample_and_retire()
            if self.running:
                self._decode()
        return finished

    def interrupt(self) -> list[GenOutput]:
        out = [s.output("abort") for s in self.running] + [s.output("abort") for s in self.waiting]
        self.running, self.waiting = [], deque()
        self._kv = self._mask = self._next_logits = None
        return out

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        if self.num_in_flight():
            raise RuntimeError("HFEngine.update_weights() with requests in flight: interrupt() or drain first")
        load_named_tensors(self.model, named_tensors)
        self.version = version

    def sleep(self, level: int = 1) -> None:
        """Free device memory for the colocated trainer: drop the KV cache and move the weights (and
        buffers such as RoPE's inv_freq, which are not in the state dict) to host memory.  Level 2 is
        treated as level 1: this engine has no way to rebuild non-persistent buffers from nothing."""
        if self.num_in_flight():
            raise RuntimeError("HFEngine.sleep() with requests in flight")
        self._kv = self._mask = self._next_logits = self._pending_tokens = None
        if self.device.is_accelerator:
            self.model.to("cpu")
            self.device.empty_cache()
        self._sleep_level = level

    def wake_up(self) -> None:
        if self._sleep_level and self.device.is_accelerator:
            self.model.to(self.torch_device)
        self._sleep_level = 0

    # ------------------------------------------------------------------ internals
    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, kv) -> tuple[torch.Tensor, list]:
        from transformers import DynamicCache

        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        cache = DynamicCache(ddp_cache_data=kv, config=self.model.config) if kv else DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        new_kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out.logits[:, -1, :].float(), new_kv

    def _admit(self) -> None:
        room = self.max_num_seqs - len(self.running)
        if room <= 0 or not self.waiting or (self.running and room < self.admit_batch):
            return
        joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        prompts = [s.req.prompt_ids for s in joining]
        length = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, length - len(p):] = 1
        ids, mask = ids.to(self.torch_device), mask.to(self.torch_device)
        logits, kv = self._forward(ids, mask, None)
        if self._kv is None:
            self._kv, self._mask, self._next_logits = kv, mask, logits
        else:
            total = max(self._mask.shape[1], length)
            self._kv = [(torch.cat([_lpad(k0, total, 2), _lpad(k1, total, 2)]),
                         torch.cat([_lpad(v0, total, 2), _lpad(v1, total, 2)]))
                        for (k0, v0), (k1, v1) in zip(self._kv, kv)]
            self._mask = torch.cat([_lpad(self._mask, total, 1), _lpad(mask, total, 1)])
            self._next_logits = torch.cat([self._next_logits, logits])
        self.running.extend(joining)

    def _sample_and_retire(self) -> list[GenOutput]:
        params = [s.req.params for s in self.running]
        dev = self.torch_device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        tokens, logps = sample_tokens(self._next_logits, temps, top_k, top_p, self.generator)
        tokens_l, logps_l = tokens.tolist(), logps.tolist()
        finished, keep = [], []
        for i, seq in enumerate(self.running):
            seq.tokens.append(tokens_l[i])
            seq.log_probs.append(logps_l[i])
            seq.versions.append(self.version)
            if tokens_l[i] in self.eos:
                finished.append(seq.output("stop"))
            elif len(seq.tokens) >= seq.req.params.max_tokens:
                finished.append(seq.output("length"))
            else:
                keep.append(i)
        self.num_generated_tokens += len(tokens_l)
        if len(keep) < len(self.running):
            idx = torch.tensor(keep, dtype=torch.long, device=dev)
            self.running = [self.running[i] for i in keep]
            self._kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self._kv]
            self._mask = self._mask.index_select(0, idx)
            tokens = tokens.index_select(0, idx)
        if not self.running:
            self._kv = self._mask = self._next_logits = None
        else:
            self._pending_tokens = tokens
        return finished

    def _decode(self) -> None:
        ids = self._pending_tokens.unsqueeze(1)                                           # (B, 1)
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)         # (B, L+1)
        self._next_logits, kv = self._forward(ids, mask, self._kv)
        first = int((mask.sum(0) > 0).nonzero()[0])  # leading columns that are padding in every row
        self._kv = [(k[:, :, first:], v[:, :, first:]) for k, v in kv] if first else kv
        self._mask = mask[:, first:]


def _lpad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Left-pad `x` with zeros along `dim` to `length`."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [missing, 0]
    return F.pad(x, pad)


def load_named_tensors(model: torch.nn.Module, named_tensors: NamedTensors) -> int:
    """Copy (name, tensor) pairs into the model's parameters/buffers in place; returns bytes loaded."""
    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded = 0
    with torch.no_grad():
        for name, tensor in items:
            if name not in params:
                raise KeyError(f"weight {name!r} does not exist in the rollout model")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            loaded += tensor.numel() * tensor.element_size()
    return loaded
