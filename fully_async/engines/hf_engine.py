"""Embedded rollout engine: pure torch + transformers, continuous batching over a slot KV cache.

Why our own loop instead of `model.generate`: the async pipeline needs requests to join the
running batch as others finish, to be cut off mid-generation at a weight update with their
partial tokens and log-probs, and to stamp each token with the weights' version.  `generate`
does none of that.

Mechanics.  The KV cache is preallocated once: per layer keys and values of shape (S, H, T, D),
S = max_num_seqs slots, T = the longest sequence the engine serves (max_model_len; it grows by
doubling if a request needs more).  A running sequence owns one slot and its length; nothing is
ever concatenated, padded or index-selected: every write goes in place.  Each `collect()` is one
engine iteration:
  1. admit waiting requests into free slots (lowest first): one prefill forward over the joining
     prompts only (right-padded, causal mask), writing their keys/values into their slots; running
     sequences are not touched.  While sequences run, admission waits until `admit_batch` slots
     (max_num_seqs / 8) are free, so the prefill forward is paid once per batch of joiners;
  2. sample one token for every occupied slot from its pending logits, on the device; one host
     transfer per step brings back the tokens and their behaviour log-probs;
  3. retire the sequences that hit EOS or max_tokens (their slot is simply freed);
  4. one decode forward over slots [0, hi) (hi = highest occupied slot + 1): each slot's new key/value
     is written at its own position and attention reads its slot up to its own length (an additive
     mask over the cache's first `span` columns, a view).
The transformers model sees a duck-typed cache (`_SlotCache.update`) and a prepared 4D mask, which
transformers passes through untouched, so any causal LM whose attention calls
`past_key_values.update(key, value, layer_idx)` works; sliding-window layers are refused.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

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


class _SlotCache:
    """What the model's attention layers call as `past_key_values`: writes in place into the slot buffers.

    prefill(slots, P): the joining prompts' keys/values go to positions [0, P) of their slots and the
    attention reads exactly those (nothing else exists for them yet).
    decode(hi, positions, span): slot i < hi writes its one new key/value at positions[i] and the attention
    reads slots [0, hi) over columns [0, span)."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._mode: tuple = ()

    def prefill(self, slots: torch.Tensor, length: int) -> "_SlotCache":
        self._mode = ("prefill", slots, length)
        return self

    def decode(self, hi: int, positions: torch.Tensor, span: int) -> "_SlotCache":
        self._mode = ("decode", hi, positions, span)
        return self

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions per slot, keeping what is cached."""
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                new[:, :, :old.shape[2]] = old
                buffers[i] = new
        self.capacity = capacity

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx == len(self.keys):  # first use: shapes come from the model's own projections
            shape = (self.slots, key.shape[1], self.capacity, key.shape[3])
            self.keys.append(key.new_zeros(shape))
            self.values.append(value.new_zeros(shape))
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if self._mode[0] == "prefill":
            _, slots, length = self._mode
            k_buf[slots, :, :length] = key                                   # key (B, H, P, D)
            v_buf[slots, :, :length] = value
            return key, value
        _, hi, positions, span = self._mode
        rows = torch.arange(hi, device=key.device)
        k_buf[rows, :, positions] = key[:, :, 0]                             # key (hi, H, 1, D)
        v_buf[rows, :, positions] = value[:, :, 0]
        return k_buf[:hi, :, :span], v_buf[:hi, :, :span]


class HFEngine:
    def __init__(self, model_path: str, device: Device, dtype: str = "float32", max_num_seqs: int = 256,
                 eos_token_ids: Optional[list[int]] = None, pad_token_id: int = 0, seed: int = 1,
                 trust_remote_code: bool = False, max_model_len: Optional[int] = None):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.torch_device = device.torch_device()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code).to(self.torch_device).eval()
        sliding = [t for t in getattr(self.model.config, "layer_types", None) or [] if t != "full_attention"]
        if sliding:
            raise ValueError(f"{model_path}: layer types {sorted(set(sliding))} are not supported by the embedded "
                             "engine's slot cache (full attention only); use actor_rollout_ref.rollout.name=vllm")
        self.base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.max_num_seqs = max_num_seqs
        self.admit_batch = max(1, max_num_seqs // 8)  # free slots that trigger an admission mid-run
        self.eos = set(eos_token_ids or [])
        self.pad_token_id = pad_token_id
        self.version = 0
        self.generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        self.waiting: deque[_Seq] = deque()
        self.slots: list[Optional[_Seq]] = [None] * max_num_seqs
        self.lengths = [0] * max_num_seqs       # tokens cached per slot (host copy)
        self.max_model_len = max_model_len or 256
        self._cache: Optional[_SlotCache] = None
        self._state: Optional[dict[str, torch.Tensor]] = None  # per-slot device tensors, see _buffers()
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
        return len(self.waiting) + sum(s is not None for s in self.slots)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        """One engine iteration (admit, sample, retire, decode); `timeout_s` is not needed here."""
        if not self.waiting and not any(s is not None for s in self.slots):
            return []
        with torch.inference_mode():
            self._admit()
            finished = self._sample_and_retire()
            if any(s is not None for s in self.slots):
                self._decode()
        return finished

    def interrupt(self) -> list[GenOutput]:
        out = [s.output("abort") for s in self.slots if s is not None] + [s.output("abort") for s in self.waiting]
        self.slots = [None] * self.max_num_seqs
        self.lengths = [0] * self.max_num_seqs
        self.waiting = deque()
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
        self._cache = self._state = None
        if self.device.is_accelerator:
            self.model.to("cpu")
            self.device.empty_cache()
        self._sleep_level = level

    def wake_up(self) -> None:
        if self._sleep_level and self.device.is_accelerator:
            self.model.to(self.torch_device)
        self._sleep_level = 0

    # ------------------------------------------------------------------ internals
    def _buffers(self, need: int) -> tuple[_SlotCache, dict[str, torch.Tensor]]:
        """The slot cache (room for `need` positions per slot) and the per-slot device state."""
        if self._cache is None:
            self._cache = _SlotCache(self.max_num_seqs, max(self.max_model_len, need))
        elif need > self._cache.capacity:
            self._cache.grow(max(need, 2 * self._cache.capacity))
        if self._state is None:
            dev, s = self.torch_device, self.max_num_seqs
            self._state = {"logits": None, "tokens": torch.zeros(s, dtype=torch.long, device=dev),
                           "lengths": torch.zeros(s, dtype=torch.long, device=dev),
                           "temperature": torch.ones(s, device=dev), "top_p": torch.ones(s, device=dev),
                           "top_k": torch.full((s,), -1, dtype=torch.long, device=dev)}
        return self._cache, self._state

    def _mask(self, query_pos: torch.Tensor, span: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Additive (B, 1, q, span) mask: key j visible to a query at position p when j <= p (and j < valid)."""
        keys = torch.arange(span, device=query_pos.device)
        allowed = keys.view(1, 1, -1) <= query_pos.unsqueeze(-1)                        # (B, q, span)
        if valid is not None:
            allowed &= keys.view(1, 1, -1) < valid.view(-1, 1, 1)
        dtype = self.lm_head.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        running = len(self.slots) - len(free)
        if not free or not self.waiting or (running and len(free) < self.admit_batch):
            return
        joining = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        slot_ids = free[:len(joining)]
        lens = [len(s.req.prompt_ids) for s in joining]
        cache, state = self._buffers(max(n + s.req.params.max_tokens for n, s in zip(lens, joining)))
        dev, width = self.torch_device, max(lens)
        ids = torch.full((len(joining), width), self.pad_token_id, dtype=torch.long)
        for i, s in enumerate(joining):
            ids[i, :lens[i]] = torch.tensor(s.req.prompt_ids, dtype=torch.long)
        ids = ids.to(dev)
        lengths = torch.tensor(lens, dtype=torch.long, device=dev)
        slots = torch.tensor(slot_ids, dtype=torch.long, device=dev)
        positions = torch.arange(width, device=dev).expand(len(joining), width)
        hidden = self.base(input_ids=ids, position_ids=positions, attention_mask=self._mask(positions, width, lengths),
                           past_key_values=cache.prefill(slots, width), use_cache=True).last_hidden_state
        last = hidden[torch.arange(len(joining), device=dev), lengths - 1]                 # (B, H)
        logits = self.lm_head(last).float()                                                 # (B, V)
        if state["logits"] is None:
            state["logits"] = torch.zeros(self.max_num_seqs, logits.shape[-1], device=dev)
        state["logits"][slots] = logits
        state["lengths"][slots] = lengths
        params = [s.req.params for s in joining]
        state["temperature"][slots] = torch.tensor([p.temperature for p in params], device=dev)
        state["top_p"][slots] = torch.tensor([p.top_p for p in params], device=dev)
        state["top_k"][slots] = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        for i, s, n in zip(slot_ids, joining, lens):
            self.slots[i], self.lengths[i] = s, n

    def _hi(self) -> int:
        return max((i for i, s in enumerate(self.slots) if s is not None), default=-1) + 1

    def _sample_and_retire(self) -> list[GenOutput]:
        hi = self._hi()
        state = self._state
        truncate = any(s is not None and (s.req.params.top_k > 0 or s.req.params.top_p < 1.0) for s in self.slots)
        tokens, logps = sample_tokens(state["logits"][:hi], state["temperature"][:hi], state["top_k"][:hi],
                                      state["top_p"][:hi], self.generator, truncate=truncate)
        state["tokens"][:hi] = tokens
        host = torch.stack([tokens.double(), logps.double()]).cpu().tolist()               # the one sync per step
        finished = []
        for i in range(hi):
            seq = self.slots[i]
            if seq is None:
                continue
            token = int(host[0][i])
            seq.tokens.append(token)
            seq.log_probs.append(host[1][i])
            seq.versions.append(self.version)
            self.num_generated_tokens += 1
            if token in self.eos or len(seq.tokens) >= seq.req.params.max_tokens:
                finished.append(seq.output("stop" if token in self.eos else "length"))
                self.slots[i] = None
        return finished

    def _decode(self) -> None:
        hi = self._hi()
        state, cache = self._state, self._cache
        span = max(self.lengths[i] for i, s in enumerate(self.slots[:hi]) if s is not None) + 1
        positions = state["lengths"][:hi]                                                   # where each new token goes
        ids = state["tokens"][:hi].unsqueeze(1)                                             # (hi, 1)
        hidden = self.base(input_ids=ids, position_ids=positions.unsqueeze(1),
                           attention_mask=self._mask(positions.unsqueeze(1), span),
                           past_key_values=cache.decode(hi, positions, span), use_cache=True).last_hidden_state
        state["logits"][:hi] = self.lm_head(hidden[:, -1]).float()
        occupied = torch.tensor([s is not None for s in self.slots[:hi]], device=positions.device)
        state["lengths"][:hi] += occupied.long()
        for i in range(hi):
            if self.slots[i] is not None:
                self.lengths[i] += 1


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
