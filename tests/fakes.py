"""Test doubles importable by Ray workers (tests/ is put on PYTHONPATH by the tests that use them)."""
import time

from fully_async.rollout.engines.hf_engine import HFEngine


class HangingEngine(HFEngine):
    """Generates normally for a few steps, then never returns from collect() (a wedged engine)."""

    def collect(self, timeout_s: float = 0.05):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls > 3:
            time.sleep(3600)
        return super().collect(timeout_s)


class SecondReplicaCrashes(HFEngine):
    """In an engine pool, replica 1 (sampling seed = trainer.seed + 1) raises after a few engine steps."""

    def __init__(self, *args, seed: int = 1, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)
        self._crash = seed == 2  # trainer.seed defaults to 1

    def collect(self, timeout_s: float = 0.05):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._crash and self._calls > 5:
            raise RuntimeError("replica exploded on purpose")
        return super().collect(timeout_s)
