"""The embedded engine's device memory across a sleep (layer 4): weights and KV cache at fixed addresses, and the
KV of responses kept in flight swapped to host memory and back.

`EngineMemory` holds three arenas (device_memory/arena.py), tagged "<job>/rollout/weights", ".../kv" and
".../state" (the decode state: pending logits, tokens, lengths, sampling parameters).  The model's parameters and
buffers are packed into the weights arena once, at start-up (their `.data` points there; the Parameter objects,
which the fused decoder and the optimizer-less model hold, stay the same).  A sleep copies the weights to one pinned
host buffer (the parameters point into it meanwhile, so a weight update that arrives while asleep lands there) and
gives the physical memory of all three arenas back to the device; a wake maps fresh memory at the same addresses,
copies the weights back and zeroes the rest.  Every address the decode graphs recorded is valid again: nothing is
captured twice.

`KvSwap` keeps the responses in flight through a sleep (pause_mode=keep, the colocated trainer's turn): the KV
positions each occupied slot has written, gathered into one packed tensor per layer, and the slots' decode state,
copied to pinned host memory before the sleep and scattered back after the wake, so they continue exactly as if
the engine had never slept (no re-prefill).

`EngineSleep` is the engine's side of a switch (HFEngine inherits it): `keeps_resident` (device_memory/policy.py's
decision for the next sleep), `sleep` / `wake_up` (nothing moves, or the arenas released and restored, or without
arenas the cache dropped and rebuilt; the swap either way) and `memory_report`.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from fully_async.device_memory.arena import ALIGN, Arena, round_up

GIB = float(1 << 30)


def _module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    out, seen = [], set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """The tensor (shape, stride) at element `offset` of the bytes `buf` read as `dtype`."""
    typed = buf.view(dtype)
    return typed.as_strided(shape, stride, typed.storage_offset() + offset)


class EngineMemory:
    def __init__(self, backend: Any, device: Any, tag: str = "run/rollout"):
        self.backend, self.device, self.tag = backend, device, tag
        self.weights: Optional[Arena] = None
        self.kv: Optional[Arena] = None
        self.state: Optional[Arena] = None
        # (tensor, its storage's bytes in the arena, (dtype, shape, stride, storage offset) in that storage)
        self._placed: list[tuple[torch.Tensor, slice, tuple]] = []
        self._host: Optional[torch.Tensor] = None                           # pinned copy of the weights arena
        self.asleep = False
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ allocation
    def _reserve(self) -> int:
        """An arena's address range: the device's size (reserving addresses costs no memory)."""
        return max(self.device.mem_info()[1], 1 << 30)

    def place_module(self, model: torch.nn.Module) -> int:
        """Move every parameter and buffer of `model` (on the device) into the weights arena; returns its bytes.
        Tensors that share a storage (fused_decode.fuse_projections' groups, laid out back to back) move as that
        storage, so they stay views of one tensor."""
        groups: dict[int, list[torch.Tensor]] = {}
        for t in _module_tensors(model):
            if t.device.type != "cpu" or not self.device.is_accelerator:
                groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        stores = [group[0].untyped_storage() for group in groups.values()]
        sizes = [round_up(store.nbytes(), ALIGN) for store in stores]
        self.weights = Arena(self.backend, f"{self.tag}/weights", sum(sizes) + self.backend.granularity)
        region = self.weights.alloc((sum(sizes),), torch.uint8)
        offset = 0
        with torch.no_grad():
            for group, store, size in zip(groups.values(), stores, sizes):
                where = slice(offset, offset + store.nbytes())
                region[where].copy_(torch.empty(0, dtype=torch.uint8, device=group[0].device).set_(store))
                for t in group:
                    layout = (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
                    t.data = _typed(region[where], *layout)
                    self._placed.append((t, where, layout))
                offset += size
        self._region = region
        # the weights' host copy, pinned once here: a first sleep would otherwise pay the pinned allocation
        self._host = torch.empty(region.shape, dtype=torch.uint8, device="cpu", pin_memory=self.device.is_accelerator)
        return self.weights.nbytes

    def kv_alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self.kv is None:
            self.kv = Arena(self.backend, f"{self.tag}/kv", self._reserve())
        return self.kv.alloc(shape, dtype)

    def state_alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self.state is None:
            self.state = Arena(self.backend, f"{self.tag}/state", self._reserve())
        return self.state.alloc(shape, dtype)

    def new_kv_arena(self) -> Optional[Arena]:
        """A growing cache moves into a new arena; returns the old one, for the caller to close once copied."""
        old, self.kv = self.kv, None
        return old

    def arenas(self) -> list[Arena]:
        return [a for a in (self.weights, self.kv, self.state) if a is not None]

    def held(self) -> dict[str, int]:
        """Device bytes each tag holds now."""
        return {a.tag: a.held for a in self.arenas()}

    # ------------------------------------------------------------------ sleep / wake
    def release(self) -> dict[str, float]:
        """Weights to the pinned host copy, every arena's memory back to the device."""
        start = time.perf_counter()
        if self.weights is not None:   # (its pinned host copy was made by place_module)
            self._host.copy_(self._region, non_blocking=True)
            self.device.synchronize()
            for t, where, layout in self._placed:
                t.data = _typed(self._host[where], *layout)
        freed = sum(a.release() for a in self.arenas())
        self.asleep = True
        self.last = {"freed_gib": freed / GIB, "release_s": time.perf_counter() - start}
        return dict(self.last)

    def restore(self) -> dict[str, float]:
        start = time.perf_counter()
        try:
            mapped = sum(a.restore() for a in self.arenas())
        except RuntimeError as exc:   # (cuda_vmm.VmmError) the trainer kept the memory the engine gave back
            free, total = self.device.mem_info()
            need = sum(a.nbytes for a in self.arenas() if not a.mapped)
            raise RuntimeError(
                f"the embedded engine cannot take its memory back after the trainer's turn: it needs "
                f"{need / GIB:.2f} GiB more, the device has {free / GIB:.2f} of {total / GIB:.2f} GiB free ({exc}); "
                "let the trainer give its memory back between turns (actor_rollout_ref.actor.fsdp_config."
                "param_offload=true / optimizer_offload=true) or lower actor_rollout_ref.rollout.max_num_seqs / "
                "max_model_len") from exc
        if self.weights is not None and self._host is not None:
            self._region.copy_(self._host, non_blocking=True)
            for t, where, layout in self._placed:
                t.data = _typed(self._region[where], *layout)
        self.device.synchronize()
        self.asleep = False
        self.last = {"mapped_gib": mapped / GIB, "restore_s": time.perf_counter() - start}
        return dict(self.last)


class HostStaging:
    """One host buffer (pinned on an accelerator) that a swap's tensors are copied into, kept from one swap to the
    next and grown when a swap needs more: a pinned allocation costs far more than the copy it serves (1x H200:
    pinning 2 GB took 1.9-2.8 s, copying it 0.05 s).  An engine whose switches will free its memory makes it at
    start-up (`EngineSleep.prepare_staging`), beside the trainer's own start, so that the first switch does not pay
    the pinning."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.buf = torch.empty(0, dtype=torch.uint8)

    def _make(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)

    def prepare(self, nbytes: int) -> None:
        """A buffer of `nbytes` now (start-up), for the swaps to come."""
        if self.buf.numel() < nbytes:
            self._make(nbytes)

    def reserve(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes`; a new buffer has half as much again, so that the next swaps (their responses a little
        longer) fit."""
        if self.buf.numel() < nbytes:
            self._make(max(int(1.5 * nbytes), int(1.25 * self.buf.numel())))
        return self.buf


class KvSwap:
    """The KV positions and decode state of the occupied slots, on the host across a sleep."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray, capacity: int, parts: list[tuple[int, tuple, Any]],
                 host: torch.Tensor, meta: tuple, names: list[str]):
        self.rows, self.lengths, self.capacity = rows, lengths, capacity
        self.parts = parts   # (offset, shape, dtype) in `host` of each layer's keys, values, then each state tensor
        self.host, self.meta, self.names = host, meta, names   # meta: (layers, kv heads, head dim, dtype)
        self.nbytes = sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size() for _, shape, dt in parts)

    @staticmethod
    def _index(rows: np.ndarray, lengths: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        slot = np.repeat(rows, lengths)
        pos = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else np.zeros(0, dtype=np.int64)
        return torch.as_tensor(slot, device=device), torch.as_tensor(pos, device=device)

    def _view(self, i: int) -> torch.Tensor:
        offset, shape, dtype = self.parts[i]
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return self.host[offset:offset + n].view(dtype).view(shape)

    @classmethod
    def out(cls, keys: list[torch.Tensor], values: list[torch.Tensor], state: dict[str, torch.Tensor],
            rows: np.ndarray, lengths: np.ndarray, device: Any, staging: HostStaging) -> "KvSwap":
        """Copy out the positions [0, lengths[i]) of slot rows[i] of every layer, and those rows' state."""
        dev = keys[0].device
        slot, pos = cls._index(rows, lengths, dev)
        index = torch.as_tensor(rows, device=dev)
        k0, tokens = keys[0], int(lengths.sum())
        shapes = [((tokens, k0.shape[1], k0.shape[3]), k0.dtype)] * (2 * len(keys)) + \
            [((len(rows),) + tuple(t.shape[1:]), t.dtype) for t in state.values()]
        parts, offset = [], 0
        for shape, dtype in shapes:
            parts.append((offset, shape, dtype))
            offset += round_up(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(), ALIGN)
        swap = cls(rows.copy(), lengths.copy(), k0.shape[2], parts, staging.reserve(offset),
                   (len(keys), k0.shape[1], k0.shape[3], k0.dtype), list(state))
        sources = [c for k, v in zip(keys, values) for c in (k, v)]
        for i, t in enumerate(sources):
            swap._view(i).copy_(t.permute(0, 2, 1, 3)[slot, pos], non_blocking=staging.pinned)
        for j, t in enumerate(state.values()):
            swap._view(len(sources) + j).copy_(t[index], non_blocking=staging.pinned)
        device.synchronize()   # the copies are on the host before the device memory goes back
        return swap

    def back(self, keys: list[torch.Tensor], values: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Scatter the saved positions and state into a (restored or rebuilt) cache of at least the same capacity."""
        dev = keys[0].device
        slot, pos = self._index(self.rows, self.lengths, dev)
        index = torch.as_tensor(self.rows, device=dev)
        targets = [c for k, v in zip(keys, values) for c in (k, v)]
        for i, t in enumerate(targets):
            t.permute(0, 2, 1, 3)[slot, pos] = self._view(i).to(dev, non_blocking=True)
        for j, name in enumerate(self.names):
            state[name][index] = self._view(len(targets) + j).to(dev, non_blocking=True)


class EngineSleep:
    """The embedded engine's side of a turn switch (HFEngine inherits it): what a sleep keeps or frees, the swap of
    the responses in flight, and the metrics of both.  It uses the engine's state: `memory` (EngineMemory or None),
    `choice` (device_memory.policy.KeepWhenFits), the slot cache and decode state, the host bookkeeping per slot."""

    swaps_in_flight = True   # sleep(keep_in_flight=True) keeps the occupied slots' KV through the sleep

    def keeps_resident(self) -> bool:
        """Will the next sleep keep this engine's memory resident (free_cache_engine=false, or true with the trainer
        fitting beside it: device_memory/policy.py)?  The answer holds for that sleep."""
        if not self.free_cache_engine:
            return True
        free, total = self.device.mem_info()
        self._decided = self.choice.decide(free, total, self.device_bytes())
        return self._decided

    STAGING_FRACTION = 0.25   # of the KV cache: what a switch's swap is taken to need before one was seen

    def prepare_staging(self) -> Optional[float]:
        """At start-up, where this engine's switches will free its memory and keep its responses in flight (CUDA:
        its memory at fixed addresses), pin the swap's host buffer now, at a quarter of the KV cache (1x H200, the
        0.5B shape with 256 slots up to 3,088 tokens: a 9.1 GiB cache, swaps of 1.5-2.1 GiB), rather than at the
        first switch; a larger swap grows it then.  Not where the engine keeps its memory (free_cache_engine=false)
        or is expected to (`auto` with the memory model's estimate of the trainer fitting beside it now).  Returns
        the GiB pinned, or None."""
        if self.memory is None or not self.device.is_accelerator or self._cache is None:
            return None
        if self.choice.would_keep(*self.device.mem_info()):
            return None
        kv = sum(t.numel() * t.element_size() for t in self._cache.keys + self._cache.values)
        if not kv:
            return None
        if self._staging is None:
            self._staging = HostStaging(True)
        self._staging.prepare(int(self.STAGING_FRACTION * kv))
        return self._staging.buf.numel() / GIB

    def device_bytes(self) -> int:
        """The device memory this engine holds for its weights, KV cache and decode state."""
        if self.memory is not None:
            return sum(a.nbytes for a in self.memory.arenas())
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if self._cache is not None:
            tensors += self._cache.keys + self._cache.values
        if self._state is not None:
            tensors += list(self._state.values())
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == self.torch_device.type)

    def sleep(self, level: int = 1, keep_in_flight: bool = False) -> None:
        """Give the device to the other tenant (the trainer's turn).  free_cache_engine=false, or a turn where the
        trainer fits beside the engine (`keeps_resident`): nothing moves.  Otherwise the memory is freed: on CUDA
        the weights go to a pinned host copy and the weights', KV cache's and decode state's memory goes back to
        the device at fixed addresses (engine_memory.py: the decode graphs stay valid); elsewhere the cache, the
        state and the graphs are dropped and the weights (and buffers such as RoPE's inv_freq, which are not in
        the state dict) moved to host memory.  keep_in_flight: requests stay in flight; the KV positions and
        decode state of the occupied slots go to host memory and come back at the wake (no re-prefill).
        Level 2 is treated as level 1: this engine has no way to rebuild non-persistent buffers from nothing."""
        if self.num_in_flight() and not keep_in_flight:
            raise RuntimeError("HFEngine.sleep() with requests in flight")
        if self._sleep_level:
            return
        keep, self._decided = (self._decided if self._decided is not None else self.keeps_resident()), None
        self._sleep_level, self._turn = level, self._worked
        self.memory_stats["sleeps"] += 1
        if keep:
            self._resident_sleep = True
            return
        self._requeue_chunk()   # a request half prefilled in chunks starts again after the wake (its KV is not kept)
        start = time.perf_counter()
        self.device.synchronize()   # a decode step queued by the last collect() may still read the buffers
        held = self.device_bytes()
        rows = np.flatnonzero(self._occ)
        swap_s = 0.0
        if len(rows) and self._cache is not None and self._cache.keys:
            with torch.inference_mode():   # (a cache made in inference mode is written only there)
                if self._staging is None:
                    self._staging = HostStaging(self.device.is_accelerator)
                self._swap = KvSwap.out(self._cache.keys, self._cache.values, self._state, rows, self._len[rows],
                                        self.device, self._staging)
            swap_s = time.perf_counter() - start
        if self.memory is not None:
            self.memory.release()
        else:
            self._cache = self._state = None
            self._graphs, self._sample_graphs = {}, {}
            if self.device.is_accelerator:
                if self._host is None:
                    from fully_async.core.host_offload import HostOffload

                    self._host = HostOffload()
                self._host.module_to_host(self.model)   # pinned buffers, reused at every sleep
                self.device.synchronize()
                self.device.empty_cache()
        self.memory_stats.update(freed_sleeps=self.memory_stats["freed_sleeps"] + 1, freed_gib=held / 2**30,
                                 sleep_s=time.perf_counter() - start, swap_out_s=swap_s,
                                 swap_gib=self._swap.nbytes / 2**30 if self._swap is not None else 0.0)

    def wake_up(self) -> None:
        if not self._sleep_level:
            return
        if self._turn:   # the other tenant had a turn: its allocator now holds what its step needed
            self.choice.other_turn_seen()
        self._sleep_level, self._worked = 0, False
        if self._resident_sleep:
            self._resident_sleep = False
            return
        start = time.perf_counter()
        if self.memory is not None:
            self.memory.restore()
            if self._state is not None:
                self._reset_state()
        else:
            if self.device.is_accelerator:
                if self._host is not None:
                    self._host.module_to_device(self.model, self.torch_device)
                else:
                    self.model.to(self.torch_device)
                if self._fused is not None:   # the weights came back one by one: lay the projection groups out again
                    self._fused.bind()
            self._invalidate_graphs()   # the weights have new addresses
        swap_s = 0.0
        if self._swap is not None:
            swap_from = time.perf_counter()
            swap, self._swap = self._swap, None
            with torch.inference_mode():
                cache, state = self._buffers(swap.capacity)
                if not cache.keys:   # a dropped cache is rebuilt at the saved shape
                    layers, heads, dim, dtype = swap.meta
                    for _ in range(layers):
                        cache.add_layer(heads, dim, dtype, self.torch_device)
                swap.back(cache.keys, cache.values, state)
            self.device.synchronize()
            swap_s = time.perf_counter() - swap_from
        self.memory_stats.update(wake_s=time.perf_counter() - start, swap_in_s=swap_s)

    def memory_report(self) -> dict[str, float]:
        """Device memory and switch metrics of this engine (the rollouter's memory/rollout/* and timing_s/switch/*)."""
        out = {"memory/rollout/engine_gib": self.device_bytes() / 2**30,
               "memory/rollout/kept_resident": float(self.choice.last),
               "memory/rollout/freed_switches": self.memory_stats["freed_sleeps"],
               "memory/rollout/graph_captures": float(self.memory_stats["graph_captures"])}
        if self.memory is not None:
            out.update({f"memory/{tag}_gib": held / 2**30 for tag, held in self.memory.held().items()})
        for key in ("freed_gib", "swap_gib"):
            if key in self.memory_stats:
                out[f"memory/rollout/{key}"] = self.memory_stats[key]
        if self._staging is not None:   # the swap's host buffer, made at start-up or at a swap, and grown since
            out["memory/rollout/swap_buffer_gib"] = self._staging.buf.numel() / 2**30
        for key in ("sleep_s", "wake_s", "swap_out_s", "swap_in_s"):
            if key in self.memory_stats:
                out[f"timing_s/switch/{key[:-2]}"] = self.memory_stats[key]
        return out
