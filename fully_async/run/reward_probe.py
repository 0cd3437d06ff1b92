"""The start-up reward probe's own bound (layer 6).

Why: the driver calls the reward function once per data_source before Ray starts (prepare.probe_rewards), so a
broken function fails in seconds, not after the engines started.  A function that hangs -- at its import, or on its
first call -- would otherwise block the start for verl's 300 s per call (reward_model.timeout_s), or for ever
in-process (timeout_s=null), with nothing on the console.  The probe therefore runs in a thread the driver watches:
it logs what it waits for (the function's file:name, the stage), says so again every few seconds while it waits,
and fails naming the function and `reward_model.probe_timeout_s` when a stage overruns it.  A worker process the
stuck call runs in is killed (`on_timeout`), so nothing keeps the driver from exiting.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Optional

from fully_async.core.config import ConfigError

logger = logging.getLogger(__name__)

KEY = "reward_model.probe_timeout_s"


def reward_function(cfg: Any) -> str:
    """'<file>:<name>' of the custom reward function, or the built-in rules."""
    custom = cfg.custom_reward_function
    if custom.path:
        return f"{custom.path}:{custom.name}"
    return f"the built-in rules (data.{cfg.data.reward_fn_key} picks one per row)"


class ProbeWatch:
    """What the probe thread is doing now (`stage`), and since when (the driver's clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.text, self.since = "starting", clock()
        self.on_timeout: Optional[Callable[[], None]] = None   # e.g. kill the reward function's worker process

    def stage(self, text: str) -> None:
        self.text, self.since = text, self.clock()
        logger.info("reward probe: %s", text)


def bounded_probe(probe: Callable[[ProbeWatch], Any], function: str, limit_s: float, log_every_s: float = 5.0,
                  clock: Callable[[], float] = time.monotonic, tick_s: float = 0.1) -> Any:
    """probe(watch) in a daemon thread; each stage it names (`watch.stage`) may take `limit_s`.  Logs what it
    waits for at the start and every `log_every_s` while a stage lasts; a stage over `limit_s` raises ConfigError
    naming the function, the stage and the key.  The probe's own exception is raised here."""
    if not (isinstance(limit_s, (int, float)) and math.isfinite(limit_s) and limit_s > 0):
        raise ConfigError(KEY, f"{limit_s!r} must be a positive number of seconds (the start-up probe's bound on "
                          "each import and call of the reward function)")
    watch = ProbeWatch(clock)
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = probe(watch)
        except BaseException as exc:  # noqa: BLE001 - raised again in the driver's thread
            out["error"] = exc

    logger.info("reward probe: calling %s once per data_source before the run (each step bounded by %s=%gs)",
                function, KEY, limit_s)
    thread = threading.Thread(target=run, name="reward-probe", daemon=True)
    thread.start()
    last_log = clock()
    while True:
        thread.join(tick_s)
        if not thread.is_alive():
            break
        now = clock()
        waited = now - watch.since
        if waited > limit_s:
            if watch.on_timeout is not None:
                watch.on_timeout()
            raise ConfigError(KEY, f"the reward function {function} did not return within {limit_s:g}s at start-up "
                              f"({watch.text}). Fix the function (a hang at its import or on a plain input), or raise "
                              f"{KEY}")
        if now - last_log >= log_every_s:
            logger.warning("reward probe: still waiting for %s after %.0fs (%s; %s=%g)", function, waited, watch.text,
                           KEY, limit_s)
            last_log = now
    if "error" in out:
        raise out["error"]
    return out.get("result")
