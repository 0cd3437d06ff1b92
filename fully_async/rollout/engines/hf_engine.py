"""Embedded rollout engine: pure torch + transformers, continuous batching over a slot KV cache, decode
replayed from device graphs.

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
     requests only, writing their keys/values into their slots; running sequences are not touched.  While sequences
     run, admission waits until `admit_batch` slots (max_num_seqs / 8) are free, so the prefill forward is paid once
     per batch of joiners.  At most `max_num_batched_tokens` (actor_rollout_ref.rollout.max_num_batched_tokens, as
     vLLM bounds its steps) tokens a step: a burst of long requests (a weight update's parked responses, prompt +
     partial response each) is prefilled over several steps that also decode.  prefill.py: packed (CUDA, the fused
     layer functions, no padding, a longer request split into chunks over steps) or right-padded (elsewhere, one
     transformers forward, a longer request alone);
     Where the running sequences are fewer than the slots below the highest of them by a batch bucket or more,
     the highest move down into the free slots (their cached keys/values, decode state and host record: `_compact`),
     so a long tail of few responses decodes at its own width, not at the width it started with;
  2. sample one token for every slot below hi (hi = highest occupied slot + 1) from its pending logits,
     on the device; one host transfer per step brings back the tokens and their behaviour log-probs,
     which land in per-slot host arrays (numpy, vectorised: no per-sequence Python work per step);
  3. one decode forward over slots [0, B) (B >= hi): each slot's new key/value is written at its own
     position and attention reads its slot up to its own length.  On CUDA the llama-family path does that with
     decode_attention.py's split-KV kernel, whose cost follows each row's real length; elsewhere an additive
     mask over the cache's first `span` columns (a view) hides the rest.  Slots that are free decode garbage
     into their own, unused, slot.  On an accelerator this step is queued before the host waits for step 2's
     transfer, so the host's bookkeeping overlaps it;
  4. retire the sequences that hit EOS or max_tokens (their slot is simply freed).
The decode forward reads and writes only persistent device buffers (last tokens, lengths, logits, the
cache), so on CUDA (and NPU where torch_npu has graphs) it is captured once per (batch bucket, span
bucket) at start-up and replayed: one launch per step instead of hundreds.  Weight updates copy into the
parameters' own storage, so the graphs stay valid; so does a sleep on CUDA, which gives the memory of the weights,
the cache and the decode state back at fixed addresses (engine_memory.py); a cache that has to grow, or a sleep
elsewhere (cpu, npu, fp8 emulation: the weights moved), drops them, and each bucket is captured again at its next use.
`enforce_eager=True` (actor_rollout_ref.rollout.enforce_eager) skips graphs.
The transformers model sees a duck-typed cache (`_SlotCache.update`) and a prepared 4D mask, which
transformers passes through untouched, so any causal LM whose attention calls
the cache's `update(key, value, layer_idx)` works; sliding-window layers are refused.
"""
from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Optional

import numpy as np
import torch

from fully_async.algorithms.sampling import sample_tokens
from fully_async.device import Device, parse_dtype
from fully_async.rollout.engines.base import NamedTensors
from fully_async.rollout.engines.engine_memory import EngineSleep
from fully_async.rollout.engines.prefill import EnginePrefill
from fully_async.core.types import GenOutput, GenRequest

logger = logging.getLogger(__name__)


class _SlotCache:
    """What the model's attention layers get as their KV cache (`cache`, `past_key_values` before transformers
    renamed it): writes in place into the slot buffers.

    prefill(slots, P): the joining prompts' keys/values go to positions [0, P) of their slots and the
    attention reads exactly those (nothing else exists for them yet).
    decode(hi, positions, span): slot i < hi writes its one new key/value at positions[i] and the attention
    reads slots [0, hi) over columns [0, span)."""

    def __init__(self, slots: int, capacity: int, alloc: Optional[Callable[..., torch.Tensor]] = None):
        self.slots, self.capacity = slots, capacity
        # where the buffers live: torch's allocator, or the engine's KV arena (engine_memory.py)
        self.alloc = alloc or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
        self.spans = span_buckets(capacity)          # attention-span buckets of the decode graphs
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
                new = self.alloc((old.shape[0], old.shape[1], capacity, old.shape[3]), old.dtype, old.device)
                new[:, :, :old.shape[2]] = old
                buffers[i] = new
        self.capacity = capacity
        self.spans = span_buckets(capacity)

    def add_layer(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (self.slots, heads, self.capacity, dim)
        self.keys.append(self.alloc(shape, dtype, device))
        self.values.append(self.alloc(shape, dtype, device))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx == len(self.keys):  # first use: shapes come from the model's own projections
            self.add_layer(key.shape[1], key.shape[3], key.dtype, key.device)
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


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model.forward` takes its KV cache: `cache` where transformers has renamed it (its
    newer releases keep `past_key_values` only as a deprecated alias that warns on every call, to be removed in
    5.40), else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


SLOT_ATTENTION = "fa_slot_attention"


def slot_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The engine's attention (registered with transformers as "fa_slot_attention").

    Decode has one query token per row, so the query heads that share a KV head become SDPA's query length:
    query (B, H, 1, D) -> (B, H_kv, H / H_kv, D) against keys/values (B, H_kv, span, D), the (B, 1, 1, span)
    mask broadcast.  Each cached key/value is read once; transformers' sdpa repeats them per query head
    whenever a mask is given (for a 7:1 GQA model that is 7x the cache traffic of every decode step).
    Prefill (several query tokens) goes to transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and query.device.type == "npu" and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0     # NPU's fused kernel takes a boolean "may attend" mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query.view(batch, kv_heads, heads // kv_heads, dim), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


def _register_slot_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention_forward)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch buckets with at most ~1/3 padding: 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, ..., max_num_seqs."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b = b * 2 if b < 32 else b + (16 if b < 64 else 32)
    return sorted(set(sizes + [max_num_seqs]))


def span_buckets(capacity: int, smallest: int = 128) -> list[int]:
    """Attention spans captured per batch bucket: powers of two from `smallest`, and the capacity itself."""
    spans, s = [], smallest
    while s < capacity:
        spans.append(s)
        s *= 2
    return spans + [capacity]


def _bucket(value: int, buckets: list[int]) -> Optional[int]:
    return next((b for b in buckets if b >= value), None)


class HFEngine(EnginePrefill, EngineSleep):
    def __init__(self, model_path: str, device: Device, dtype: str = "float32", max_num_seqs: int = 256,
                 eos_token_ids: Optional[list[int]] = None, pad_token_id: int = 0, seed: int = 1,
                 trust_remote_code: bool = False, max_model_len: Optional[int] = None, enforce_eager: bool = True,
                 graph_batch_sizes: Optional[list[int]] = None, free_cache_engine: bool = True,
                 fused_decode: bool = True, split_kv: Optional[bool] = None, keep_in_flight: bool = False,
                 quantization: Optional[str] = None, max_num_batched_tokens: Optional[int] = None,
                 keep_when_fits: bool = False, device_memory: str = "auto", memory_tag: str = "run/rollout",
                 trainer_estimate_bytes: Optional[float] = None, stage_swaps: bool = False,
                 packed_prefill: Optional[bool] = None, chunked_prefill: bool = True):
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        self.device = device
        self.torch_device = device.torch_device()
        _register_slot_attention()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code,
            attn_implementation=SLOT_ATTENTION).to(self.torch_device).eval()
        sliding = [t for t in getattr(self.model.config, "layer_types", None) or [] if t != "full_attention"]
        if sliding:
            raise ValueError(f"{model_path}: layer types {sorted(set(sliding))} are not supported by the embedded "
                             "engine's slot cache (full attention only); use actor_rollout_ref.rollout.name=vllm")
        self.base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        self._cache_kw = cache_keyword(self.base)
        self.lm_head = self.model.get_output_embeddings()
        # rollout.quantization=fp8: verl's blockwise fp8 arithmetic, emulated (core/fp8.py) over transformers'
        # modules (their linear layers carry the activation rounding; the fused decode functions do not)
        self.fp8 = None
        if quantization is not None:
            from fully_async.core.fp8 import QUANTIZATIONS, Fp8Emulation

            if quantization not in QUANTIZATIONS:
                raise ValueError(f"actor_rollout_ref.rollout.quantization={quantization!r} is not one of "
                                 f"{list(QUANTIZATIONS)}")
            self.fp8 = Fp8Emulation(self.model, self.base)
            if fused_decode:
                logger.info("embedded engine: fp8 rollout emulated over transformers' decode forward")
                fused_decode = False
        # free_cache_engine: freed at every switch, or (keep_when_fits) kept resident where the trainer fits beside it
        from fully_async.device_memory.policy import KeepWhenFits

        self.choice = KeepWhenFits("keep" if not free_cache_engine else "auto" if keep_when_fits else "free",
                                   estimate_bytes=trainer_estimate_bytes)
        self._decided: Optional[bool] = None     # keeps_resident()'s answer, for the sleep that follows it
        self._resident_sleep = False             # asleep without freeing anything
        self._turn = False                       # the current sleep followed generation (the trainer's turn)
        self._worked = False                     # generated since the last wake: the sleep is a real turn switch
        self._swap: Optional[Any] = None         # responses kept in flight through a sleep (engine_memory.KvSwap)
        self._staging: Optional[Any] = None      # its host buffer, kept from one sleep to the next
        self.memory_stats: dict[str, float] = {"sleeps": 0.0, "freed_sleeps": 0.0, "graph_captures": 0.0}
        # the fused decode forward (llama-family models): its projection groups back to back before the weights take
        # their places (fused_decode.py)
        unfused = None
        if fused_decode:
            from fully_async.rollout.engines.fused_decode import fuse_projections, unsupported_reason

            unfused = unsupported_reason(self.model)
            if unfused is None:
                fuse_projections(self.model)
        # weights, KV cache and decode state at fixed addresses whose memory a sleep gives back (CUDA VMM): the
        # decode graphs stay valid across a sleep; elsewhere (cpu, npu, fp8 emulation) a sleep drops and rebuilds
        self.memory = None
        if free_cache_engine and self.fp8 is None:
            from fully_async.device_memory.arena import memory_backend

            backend, why = memory_backend(device, device_memory)
            if backend is not None:
                from fully_async.rollout.engines.engine_memory import EngineMemory

                self.memory = EngineMemory(backend, device, memory_tag)
                self.memory.place_module(self.model)
                device.empty_cache()
            else:
                logger.debug("embedded engine: sleep drops and rebuilds its memory (%s)", why)
        self.max_num_seqs = max_num_seqs
        self.admit_batch = max(1, max_num_seqs // 8)  # free slots that trigger an admission mid-run
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"HFEngine(max_num_batched_tokens={max_num_batched_tokens}): must be >= 1 (or None: "
                             "no budget)")
        self.max_num_batched_tokens = max_num_batched_tokens   # prefill tokens per step (None: no bound)
        self.chunked_prefill = chunked_prefill   # packed: a longer request split over steps (prefill.py)
        self._chunk: Optional[list] = None       # [slot, request, positions prefilled] of the one being split
        self.eos = set(eos_token_ids or [])
        self._eos = np.array(sorted(self.eos), dtype=np.int64)
        self.pad_token_id = pad_token_id
        self.version = 0
        self.generator = torch.Generator(device=self.torch_device).manual_seed(seed)
        self.waiting: deque[GenRequest] = deque()
        self.slots: list[Optional[GenRequest]] = [None] * max_num_seqs
        # host bookkeeping per slot (numpy, vectorised per step): occupied, tokens cached, tokens generated
        # and allowed, and the generated tokens / behaviour log-probs so far
        self._occ = np.zeros(max_num_seqs, dtype=bool)
        self._len = np.zeros(max_num_seqs, dtype=np.int64)
        self._gen = np.zeros(max_num_seqs, dtype=np.int64)
        self._max = np.zeros(max_num_seqs, dtype=np.int64)
        self._truncates = np.zeros(max_num_seqs, dtype=bool)   # samples with top-k or top-p < 1
        self._tok = np.zeros((max_num_seqs, 0), dtype=np.int64)
        self._lp = np.zeros((max_num_seqs, 0), dtype=np.float64)
        # the param version of each recorded token, and of the logits each slot samples its next token from (a
        # keep-mode update lands between a step's decode and the next step's sampling: that token is the old one's)
        self._ver = np.zeros((max_num_seqs, 0), dtype=np.int64)
        self._logit_ver = np.zeros(max_num_seqs, dtype=np.int64)
        # update_weights() may run with requests in flight (actor_rollout_ref.rollout.pause_mode=keep): they continue
        # on the new weights with the KV cache the old ones wrote, every token stamped with the version whose logits
        # it was sampled from (the behaviour log-probs are those of the tokens as sampled)
        self.keeps_in_flight = keep_in_flight
        self.cached_token_steps = 0   # tokens the running sequences had cached, summed over decode steps
        self.last_update_timings: dict[str, float] = {}
        self.max_model_len = max_model_len or 256
        self._cache: Optional[_SlotCache] = None
        self._state: Optional[dict[str, torch.Tensor]] = None  # per-slot device tensors, see _buffers()
        self._sleep_level = 0
        self.free_cache_engine = free_cache_engine
        self._host: Optional[Any] = None   # pinned host buffers of sleep(), made at the first one
        self._pinned: Optional[torch.Tensor] = None   # each step's (token, log-prob) per slot, copied asynchronously
        self._copied: Optional[Any] = None            # the device event that marks that copy done
        # device graphs of the decode step, keyed by (batch bucket, span bucket)
        self._graph_api = None if enforce_eager else device.graphs()
        self.graph_batch_sizes = sorted(b for b in (graph_batch_sizes or default_graph_batch_sizes(max_num_seqs))
                                        if b <= max_num_seqs)
        if self._graph_api is not None and max_num_seqs not in self.graph_batch_sizes:
            self.graph_batch_sizes.append(max_num_seqs)
        self._graphs: dict[tuple[int, int], Callable[[], None]] = {}
        self._sample_graphs: dict[tuple[int, bool], Callable[[], None]] = {}   # keyed by (batch bucket, truncate)
        self.graph_capture_s = 0.0
        if not enforce_eager and self._graph_api is None and device.is_accelerator:
            logger.warning("%s: this torch has no device graphs; the embedded engine decodes eagerly", device.name)
        # the decode forward: llama-family models take fused_decode.py's per-layer functions, compiled where the
        # device has a backend and graphs capture them; any other model (or fused_decode=False) transformers' modules
        self._fused = None
        if fused_decode:
            from fully_async.rollout.engines.fused_decode import FusedDecoder

            if unfused is None:
                split = self._want_split_kv(split_kv)   # the Triton decode kernels: attention and the MLP's half
                self._fused = FusedDecoder(self.model, device.compile_backend() if self._graph_api else None,
                                           split_kv=split, fused_mlp=split)
            else:
                logger.info("embedded engine: transformers' decode forward (%s)", unfused)
        elif split_kv:
            raise ValueError("HFEngine(split_kv=True) needs fused_decode=True (the split-KV attention is part of the "
                             "fused decode forward)")
        self.compiled = self._fused is not None and self._fused.compiled
        self.packed_prefill = self._want_packed_prefill(packed_prefill)
        if self._graph_api is not None:
            self._capture_graphs()
        staged = self.prepare_staging() if stage_swaps else None
        self.startup_s = time.perf_counter() - start
        logger.info("embedded engine on %s ready in %.1fs (%s%s)", device.name, self.startup_s,
                    f"{len(self._graphs)} {'compiled ' if self.compiled else ''}decode graphs captured in "
                    f"{self.graph_capture_s:.1f}s" if self._graph_api is not None else "eager decode",
                    f"; {staged:.2f} GiB of pinned host memory for the swaps of its switches" if staged else "")

    # ------------------------------------------------------------------ contract
    def submit(self, requests: list[GenRequest]) -> None:
        if self._sleep_level:
            raise RuntimeError("HFEngine.submit() while asleep: call wake_up() first")
        for req in requests:
            if not req.prompt_ids:
                raise ValueError(f"request {req.request_id} has an empty prompt")
            self.waiting.append(req)

    def num_in_flight(self) -> int:
        return len(self.waiting) + int(self._occ.sum()) + (self._chunk is not None)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        """One engine iteration (admit, sample, decode, retire); `timeout_s` is not needed here.

        On an accelerator the next decode step is queued before the host waits for this step's tokens, so the
        host's bookkeeping overlaps the device's decode instead of leaving the device idle (1x H200, 0.5B shape,
        256 rows: ~0.2-0.5 ms of a 2.4-3.9 ms step); rows that finish at this step decode once more into their
        own (then free) slot, which nothing reads."""
        if not self.waiting and not self._occ.any() and self._chunk is None:
            return []
        self._worked = True
        with torch.inference_mode():
            self._admit()
            if not self._occ.any():   # the step prefilled a chunk of a long request and nothing runs yet
                return []
            self._compact()
            host = self._sample()
            sampled_from = self._logit_ver.copy()   # the versions of the logits this step sampled from
            if self.device.is_accelerator:
                self._decode()
                return self._retire(host, sampled_from)
            finished = self._retire(host, sampled_from)  # cpu: no overlap to win; decode only the rows still running
            if self._occ.any():
                self._decode()
        return finished

    def interrupt(self) -> list[GenOutput]:
        out = [self._output(i, "abort") for i in np.flatnonzero(self._occ)] + self._drop_chunk()
        out += [GenOutput(r.request_id, [], [], [], "abort") for r in self.waiting]
        self.slots = [None] * self.max_num_seqs
        self._occ[:] = False
        self.waiting = deque()
        return out

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        kept = self.num_in_flight()
        if kept and not self.keeps_in_flight:
            raise RuntimeError("HFEngine.update_weights() with requests in flight: interrupt() or drain first "
                               "(or set actor_rollout_ref.rollout.pause_mode=keep)")
        start = time.perf_counter()
        # in place: the captured graphs read the same storage; on an accelerator the copy is ordered after the
        # decode step the last collect() queued on the same stream
        if self.fp8 is None:
            load_named_tensors(self.model, named_tensors)
        else:
            names: list[str] = []
            load_named_tensors(self.model, _recording(named_tensors, names))
            self.fp8.requantize(names)
        self.version = version
        if self.keeps_in_flight:
            self.last_update_timings = {"pause": 0.0, "load": time.perf_counter() - start, "resume": 0.0}
            if kept:
                logger.info("embedded engine: weights v%d loaded with %d requests kept in flight", version, kept)

    # ------------------------------------------------------------------ internals
    def _want_split_kv(self, asked: Optional[bool]) -> bool:
        """Decode attention that reads each row's own length (decode_attention.py) where it runs: by default on
        CUDA in 16/32-bit floats; split_kv=False keeps the masked SDPA over the span bucket (and so does the CPU,
        unless asked: the unit tests run the kernel there under Triton's interpreter)."""
        from fully_async.rollout.engines.decode_attention import supported

        if asked is False:
            return False
        reason = supported(self.torch_device.type, self.lm_head.weight.dtype)
        if asked and reason is not None:
            raise ValueError(f"HFEngine(split_kv=True): the split-KV decode attention does not run here ({reason}); "
                             "use split_kv=None (auto) or False")
        return reason is None and (bool(asked) or self.torch_device.type == "cuda")

    def _buffers(self, need: int) -> tuple[_SlotCache, dict[str, torch.Tensor]]:
        """The slot cache (room for `need` positions per slot) and the per-slot device state."""
        kv_alloc = None if self.memory is None else lambda shape, dtype, device: self.memory.kv_alloc(shape, dtype)
        if self._cache is None:
            self._cache = _SlotCache(self.max_num_seqs, max(self.max_model_len, need), kv_alloc)
        elif need > self._cache.capacity:
            logger.warning("a request needs %d positions, the slot cache has %d: growing it (raise "
                           "actor_rollout_ref.rollout.max_model_len to avoid this)", need, self._cache.capacity)
            old = self.memory.new_kv_arena() if self.memory is not None else None
            self._cache.grow(max(need, 2 * self._cache.capacity))
            if old is not None:
                old.close()
            self._invalidate_graphs()   # the cache buffers moved
        capacity = self._cache.capacity
        if self._tok.shape[1] < capacity:   # host history: a slot generates at most `capacity` tokens
            grow = capacity - self._tok.shape[1]
            self._tok = np.pad(self._tok, ((0, 0), (0, grow)))
            self._lp = np.pad(self._lp, ((0, 0), (0, grow)))
            self._ver = np.pad(self._ver, ((0, 0), (0, grow)))
        if self._state is None:
            s, vocab = self.max_num_seqs, self.lm_head.weight.shape[0]
            new = ((lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.torch_device))
                   if self.memory is None else self.memory.state_alloc)
            self._state = {"logits": new((s, vocab), torch.float32), "tokens": new((s,), torch.long),
                           "lengths": new((s,), torch.long), "temperature": new((s,), torch.float32),
                           "top_p": new((s,), torch.float32), "top_k": new((s,), torch.long),
                           "sampled": new((s, 2), torch.float64)}
            self._reset_state()
        return self._cache, self._state

    def _reset_state(self) -> None:
        """Every slot's decode state as a free slot's (sampling parameters valid: free rows are sampled too)."""
        state = self._state
        for name in ("logits", "tokens", "lengths"):
            state[name].zero_()
        state["temperature"].fill_(1.0)
        state["top_p"].fill_(1.0)
        state["top_k"].fill_(-1)

    def _mask(self, query_pos: torch.Tensor, span: int) -> torch.Tensor:
        """Additive (B, 1, q, span) mask: key j visible to a query at position p when j <= p."""
        keys = torch.arange(span, device=query_pos.device)
        allowed = keys.view(1, 1, -1) <= query_pos.unsqueeze(-1)                        # (B, q, span)
        dtype = self.lm_head.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def _compact(self) -> None:
        """Move running sequences down into free slots when the rows below the highest one would take a larger batch
        bucket than the running sequences need.  Every step decodes (and samples) all the rows below the highest
        occupied slot, so a tail of a few long responses left in high slots, after the short ones in between
        finished, would keep paying for the whole width (1x H200, seed-003 shape, 512 slots: sync's generating
        phase took 12.3 s instead of 10.6 with 256).  Admission fills the lowest free slots first, so this is mostly
        needed when nothing waits.  A move copies the slot's cached keys and values (its cached positions only),
        its decode state (pending logits, length, sampling parameters) and its host record; the sequence then
        continues in its new slot as it would have in its old one (only the row its random draws come from
        changes)."""
        occupied = np.flatnonzero(self._occ)
        count = len(occupied)
        if not count or self._chunk is not None or _bucket(int(occupied[-1]) + 1, self.graph_batch_sizes) == \
                _bucket(count, self.graph_batch_sizes):
            return
        src = occupied[occupied >= count]                 # the running sequences above the first `count` slots
        dst = np.flatnonzero(~self._occ[:count])          # as many free slots below
        cached = int(self._len[src].max())
        generated = int(self._gen[src].max())
        s = torch.as_tensor(src, device=self.torch_device)
        d = torch.as_tensor(dst, device=self.torch_device)
        for buf in self._cache.keys + self._cache.values:
            buf[d, :, :cached] = buf[s, :, :cached]
        for tensor in self._state.values():
            tensor[d] = tensor[s]
        for arr in (self._len, self._gen, self._max, self._truncates, self._logit_ver):
            arr[dst] = arr[src]
        for arr in (self._tok, self._lp, self._ver):
            arr[dst, :generated] = arr[src, :generated]
        for i, j in zip(dst, src):
            self.slots[i], self.slots[j] = self.slots[j], None
        self._occ[dst], self._occ[src] = True, False

    def _hi(self) -> int:
        occupied = np.flatnonzero(self._occ)
        return int(occupied[-1]) + 1 if len(occupied) else 0

    def _output(self, i: int, reason: str) -> GenOutput:
        n = int(self._gen[i])
        return GenOutput(self.slots[i].request_id, self._tok[i, :n].tolist(), self._lp[i, :n].tolist(),
                         self._ver[i, :n].tolist(), reason)

    def _sample(self) -> Callable[[], np.ndarray]:
        """Sample one token per slot below hi into the device state; returns how to wait for (tokens, log-probs)
        on the host: on an accelerator an asynchronous copy into pinned memory, waited for after the next
        decode step is queued (the one sync per step).  Where graphs may draw random numbers (CUDA) the sampling
        replays a graph per (batch bucket, truncation) as the decode step does: ~10 kernels launched as one."""
        hi = self._hi()
        truncate = bool((self._truncates[:hi] & self._occ[:hi]).any())
        if self._graph_api is None or not getattr(self._graph_api, "rng", False):
            self._sample_rows(hi, truncate)
        else:
            key = (_bucket(hi, self.graph_batch_sizes), truncate)
            replay = self._sample_graphs.get(key)
            if replay is not None:
                replay()
            else:   # as _decode: this step samples eagerly at the bucket's shape, then the graph is captured
                self._sample_rows(*key)
                self._sample_graphs[key] = self._graph_api.capture(partial(self._sample_rows, *key), warmup=0,
                                                                   generators=(self.generator,))
        sampled = self._state["sampled"][:hi]
        if not self.device.is_accelerator:
            host = sampled.numpy().T.copy()
            return lambda: host
        if self._pinned is None:
            self._pinned = torch.empty(self.max_num_seqs, 2, dtype=torch.float64, pin_memory=True)
            self._copied = self.device.module().Event()
        self._pinned[:hi].copy_(sampled, non_blocking=True)
        self._copied.record()
        pinned = self._pinned[:hi].numpy().T     # (2, hi): tokens, log-probs

        def wait() -> np.ndarray:
            self._copied.synchronize()
            return pinned
        return wait

    def _sample_rows(self, batch: int, truncate: bool) -> None:
        """Sample slots [0, batch) from the logits in the device state: the tokens into state["tokens"] (the next
        decode's input), tokens and behaviour log-probs into state["sampled"].  Reads and writes only persistent
        device buffers (and draws from self.generator), so it can be captured as a device graph."""
        state = self._state
        tokens, logps = sample_tokens(state["logits"][:batch], state["temperature"][:batch], state["top_k"][:batch],
                                      state["top_p"][:batch], self.generator, truncate=truncate)
        state["tokens"][:batch] = tokens
        state["sampled"][:batch, 0] = tokens
        state["sampled"][:batch, 1] = logps

    def _retire(self, wait: Callable[[], np.ndarray], versions: np.ndarray) -> list[GenOutput]:
        """Record this step's tokens, log-probs and versions per slot; free the slots that hit EOS or max_tokens."""
        host = wait()
        hi = host.shape[1]
        rows = np.flatnonzero(self._occ[:hi])
        step_tokens = host[0, rows].astype(np.int64)
        at = self._gen[rows]
        self._tok[rows, at] = step_tokens
        self._lp[rows, at] = host[1, rows]
        self._ver[rows, at] = versions[rows]
        self._gen[rows] += 1
        eos = np.isin(step_tokens, self._eos)
        done = eos | (self._gen[rows] >= self._max[rows])
        finished = [self._output(i, "stop" if hit else "length") for i, hit in zip(rows[done], eos[done])]
        for i in rows[done]:
            self.slots[i] = None
        self._occ[rows[done]] = False
        return finished

    def _decode(self) -> None:
        hi = self._hi()
        rows = np.flatnonzero(self._occ[:hi])
        span = int(self._len[rows].max()) + 1          # the longest running sequence, its new token included
        self.cached_token_steps += int(self._len[rows].sum())   # what this step's attention reads (the planner)
        self._len[rows] += 1
        self._logit_ver[rows] = self.version
        if self._graph_api is None:
            self._decode_step(hi, span)
            return
        key = (_bucket(hi, self.graph_batch_sizes), _bucket(span, self._cache.spans))
        replay = self._graphs.get(key)
        if replay is not None:
            replay()
            return
        # a bucket not captured since the graphs were invalidated: this step runs eagerly at the bucket's shape,
        # then is captured (capturing records kernels, it runs nothing)
        self._decode_step(*key)
        start = time.perf_counter()
        self._graphs[key] = self._graph_api.capture(partial(self._decode_step, *key), warmup=0)
        self.graph_capture_s += time.perf_counter() - start
        self.memory_stats["graph_captures"] += 1

    def _invalidate_graphs(self) -> None:
        """The buffers a graph reads moved: drop every graph; buckets are captured again at their next use, into
        a fresh memory pool."""
        if self._graph_api is not None:
            self._graphs, self._sample_graphs = {}, {}
            self._graph_api = self.device.graphs()

    def _decode_step(self, batch: int, span: int) -> None:
        """The decode forward over slots [0, batch), attending over cache columns [0, span).  Reads and writes
        only persistent device buffers, so it can be captured as a device graph."""
        state, cache = self._state, self._cache
        positions = state["lengths"][:batch].clamp(max=cache.capacity - 1)                # where each new token goes
        ids = state["tokens"][:batch].unsqueeze(1)                                          # (batch, 1)
        split_kv = self._fused is not None and self._fused.split_kv
        mask = None if split_kv else self._mask(positions.unsqueeze(1), span)   # split-KV reads per-row lengths
        if self._fused is not None:
            last = self._fused(ids, positions, mask, cache.keys, cache.values, span)
        else:
            out = self.base(input_ids=ids, position_ids=positions.unsqueeze(1), attention_mask=mask,
                            **{self._cache_kw: cache.decode(batch, positions, span)}, use_cache=True)
            last = out.last_hidden_state[:, -1]
        state["logits"][:batch] = self.lm_head(last).float()
        state["lengths"][:batch] = positions + 1

    def _capture_graphs(self) -> None:
        """At start-up: capture the decode step for every (batch bucket, span bucket), largest first (they share
        one memory pool).  A one-token prefill into slot 0 allocates the cache and device state first; the
        warm-up runs write only unused slots' junk (nothing runs yet)."""
        start = time.perf_counter()
        with torch.inference_mode():
            cache, state = self._buffers(self.max_model_len)
            one = torch.zeros(1, 1, dtype=torch.long, device=self.torch_device)
            self.base(input_ids=one, position_ids=one, attention_mask=self._mask(one, 1),
                      **{self._cache_kw: cache.prefill(one[0], 1)}, use_cache=True)
            if self.packed_prefill:   # compiles the packed prefill's variant of the layer functions now, not mid-run
                self._prefill_packed([[0, 0]], np.zeros(1, dtype=np.int64), [2], cache)
            for batch in sorted(self.graph_batch_sizes, reverse=True):
                for span in sorted(cache.spans, reverse=True):
                    self._graphs[(batch, span)] = self._graph_api.capture(partial(self._decode_step, batch, span))
            state["lengths"].zero_()
        self.device.synchronize()
        self.graph_capture_s += time.perf_counter() - start


def _recording(named_tensors: NamedTensors, names: list[str]) -> Any:
    """The (name, tensor) pairs of `named_tensors` (a dict, list or stream), each name appended to `names`."""
    for name, tensor in (named_tensors.items() if hasattr(named_tensors, "items") else named_tensors):
        names.append(name)
        yield name, tensor


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
            params[name].copy_(tensor)   # casts and crosses devices in one copy (a sleeping engine: into its host copy)
            loaded += tensor.numel() * tensor.element_size()
    return loaded
