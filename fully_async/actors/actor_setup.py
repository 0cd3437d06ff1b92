"""What every actor does first (layer 6): logging, config object, device, threads, tokenizer."""
from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Optional

from fully_async.core.config import FullyAsyncConfig, typed_config


def actor_init(cfg: FullyAsyncConfig, role: str, uses_device: bool = True) -> tuple[FullyAsyncConfig, Any]:
    """The typed config (as shipped, or from a plain dict), the device, CPU threads pinned.

    `uses_device=False`: an actor that drives others and holds no accelerator itself.  From here the actor beats
    (cluster/heartbeat.py): the driver sees it stall, start-up included."""
    from fully_async.cluster import heartbeat

    heartbeat.start(role)
    import torch

    from fully_async.device import get_device

    logging.basicConfig(level=logging.INFO, format=f"[{role}] %(message)s", force=True)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    cfg = typed_config(cfg)
    import_external_lib(cfg)
    device = get_device(cfg.trainer.device)
    if device.is_accelerator:
        if uses_device:
            device.set_device(0)  # Ray exposes exactly this actor's devices, renumbered from 0
    else:
        # as many threads as Ray gave this actor cores: rollouter and trainer run side by side
        torch.set_num_threads(assigned_cpus())
    torch.manual_seed(cfg.trainer.seed)
    return cfg, device


def assigned_cpus() -> int:
    """CPU cores Ray assigned to the calling actor (1 outside Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except Exception:  # noqa: BLE001 - not in a Ray worker
        pass
    return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))


def build_tokenizer(cfg: FullyAsyncConfig) -> Any:
    """The policy's tokenizer, from actor_rollout_ref.model.tokenizer_path where set (else model.path), with
    model.custom_chat_template in place of its own template where one is set (as verl's HFModelConfig)."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path,
                                              trust_remote_code=model.trust_remote_code)
    if model.custom_chat_template is not None:
        tokenizer.chat_template = model.custom_chat_template
    return tokenizer


def import_external_lib(cfg: FullyAsyncConfig) -> None:
    """actor_rollout_ref.model.external_lib, imported in this process before any model loads (verl's
    import_external_libs): a module that registers a custom architecture with transformers' Auto classes."""
    if cfg.actor_rollout_ref.model.external_lib:
        importlib.import_module(cfg.actor_rollout_ref.model.external_lib)


class MetricsOutbox:
    """(step, metrics) an actor reports straight to the driver, which drains every running actor's outbox
    (`pop_metrics`) and logs them at those steps.  Subclasses call `_init_outbox()`."""

    def _init_outbox(self) -> None:
        import threading

        self._metrics: list[tuple[int, dict]] = []
        self._lock = threading.Lock()

    def pop_metrics(self) -> list[tuple[int, dict]]:
        with self._lock:
            out, self._metrics = self._metrics, []
        return out

    def _emit(self, step: int, metrics: dict) -> None:
        """`metrics` of `step`, stamped with the time they were produced (telemetry.metrics.WALL_TIME): the driver
        writes them later, at its next drain, and TensorBoard keeps this time, the step's own end."""
        import time

        from fully_async.telemetry.metrics import WALL_TIME

        with self._lock:
            self._metrics.append((step, dict(metrics, **{WALL_TIME: time.time()})))


class DriverFacing(MetricsOutbox):
    """What the driver calls on the main actor of a run (Trainer, SyncWorker): metrics outbox,
    stop request, checkpoint requests, timeline.  Subclasses set `self.timeline`, implement
    `save_part(folder)` and call `_init_driver_facing()`."""

    def _init_driver_facing(self) -> None:
        import threading

        self._init_outbox()
        self._stop_requested = False
        self._checkpoint = threading.Condition()
        self._checkpoint_wanted: Optional[int] = None
        self._checkpoint_path: Optional[str] = None

    def checkpoint_wanted(self) -> Optional[int]:
        """The param version run() waits to have checkpointed (the driver then has every actor save its part
        and answers `checkpoint_done`), or None."""
        return self._checkpoint_wanted

    def checkpoint_done(self, path: str) -> None:
        with self._checkpoint:
            self._checkpoint_wanted, self._checkpoint_path = None, path
            self._checkpoint.notify_all()

    def _await_checkpoint(self, version: int) -> str:
        """Ask the driver for checkpoint `version` and wait until it is complete; returns its folder."""
        with self._checkpoint:
            self._checkpoint_wanted, self._checkpoint_path = version, None
            self._checkpoint.wait_for(lambda: self._checkpoint_path is not None)
            return self._checkpoint_path

    def ready(self) -> bool:
        return True

    def request_stop(self) -> None:
        """Finish the current step, checkpoint, and return from run() (SIGTERM/SIGINT)."""
        self._stop_requested = True

    def get_timeline(self) -> list[dict]:
        return self.timeline.drain()
