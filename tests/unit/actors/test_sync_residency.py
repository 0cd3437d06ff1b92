"""The sync worker's engines and trainer take turns (placement/residency Turns).  On a shared pool, the loop keeps its
weights on the devices only inside its leases: every wake/onload comes after the
acquire and every sleep/offload before the release of the same phase; the weight update goes into the sleeping
embedded engine at the end of the train phase, or (an engine that cannot load asleep) rides on the next phase
that needs the engines; each phase reports its durations and memory (fakes for the pool, engines, trainer)."""
import contextlib
from types import SimpleNamespace

import pytest

from fully_async.placement.residency import Dedicated, PoolLease, Turns
from fully_async.actors.sync_loop import SyncWorker
from fully_async.telemetry.metrics import StaleCounter
from fully_async.core.trainer_state import TrainerState
from fully_async.core.config import typed_config
from fully_async.telemetry.timeline import Timeline
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config


class Recorder:
    def __init__(self):
        self.events = []


class FakeLease:
    def __init__(self, rec):
        self.rec, self.current, self.polls = rec, None, 0

    def renew(self):
        return False

    @contextlib.contextmanager
    def phase(self, name):
        assert self.current is None, "a second lease while holding one"
        self.rec.events.append(("acquire", name))
        ph = type("Ph", (), {})()
        ph.waited_s, ph.spans = 0.25, []

        @contextlib.contextmanager
        def span(n, **args):
            yield dict(args)
        ph.span = span
        self.current = ph
        try:
            yield ph
        finally:
            self.current = None
            self.rec.events.append(("release", name))


class Fake:
    """Records every call as (name,); `returns` gives results by method name."""

    def __init__(self, rec, prefix, returns=None):
        self._rec, self._prefix, self._returns = rec, prefix, returns or {}

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self._rec.events.append((f"{self._prefix}.{name}",))
            return self._returns.get(name)
        return call


@pytest.fixture(params=["pool"])
def worker(monkeypatch, request):
    import fully_async.train.train_step as train_step_mod

    rec = Recorder()
    import fully_async.actors.sync_loop as sync_loop

    monkeypatch.setattr(sync_loop, "run_to_completion", lambda pool, ps, tools: rec.events.append(("generate",)))
    monkeypatch.setattr(train_step_mod, "train_step",
                        lambda *a, **k: (rec.events.append(("train",)) or {"perf/total_num_tokens": 10.0}, []))
    w = object.__new__(SyncWorker)
    w.cfg = typed_config(load_config(["mode=sync", "trainer.device=cpu", "trainer.test_freq=2"]))
    w.device, w.timeline = CPU, Timeline("sync")
    outer = PoolLease(FakeLease(rec)) if request.param == "pool" else Dedicated()
    w.turns = Turns(outer, engines=(w._switch(lambda: w.pool.wake_up(), "onload"),
                                    w._switch(lambda: w.pool.sleep(1), "offload", engines=True)),
                    trainer=(w._switch(w._trainer_on, "onload"), w._switch(w._trainer_off, "offload")))
    if w.turns.shared:   # built under the setup lease, both tenants left the devices
        w.turns.on = {"engines": False, "trainer": False}
    w.offload_trainer = w.turns.shared
    w.pool = Fake(rec, "engines", {"engine_stats": [], "memory_report": {"memory/rollout/freed_gib": 1.0}})
    w.backend = Fake(rec, "trainer")
    w.weight_sync = Fake(rec, "weights", {"push": {"timing_s/param_sync": 0.0}})
    w.val_records, w.engine_version, w.state = ["v"], 0, TrainerState(total_steps=3)
    w.loads_asleep = False   # the path of engines that load at their next wake-up (vLLM); the test below: True
    w.stream = type("S", (), {"exhausted": False})()
    w.num_devices, w.pad_token_id, w.last_checkpoint, w._validations = 1, 0, None, 0
    w.stale = StaleCounter()
    w.filter = None
    w.rm_inputs = None   # rule rewards (a reward model scores in a trainer phase of its own)
    w.tools = None       # single-turn
    w._draw_groups = lambda count: [("e0-p0", None, 0, [])]
    w._score_groups = lambda groups_in: rec.events.append(("reward",)) or [SimpleNamespace(samples=[])]
    w._init_driver_facing()
    monkeypatch.setattr("fully_async.actors.sync_loop.SyncWorker._validate",
                        lambda self: rec.events.append(("validate",)) or {"val-core/x/reward/mean@1": 1.0})
    return w, rec


def leased_phases(events):
    """The events inside each lease, in order; anything outside a lease must be reward scoring (it holds nothing)."""
    held, phases = False, []
    for ev in events:
        if ev[0] == "acquire":
            held = True
            phases.append([])
        elif ev[0] == "release":
            held = False
        elif not held:
            assert ev == ("reward",), f"{ev} outside any lease: {events}"
        else:
            phases[-1].append(ev[0])
    return phases


def test_weights_are_on_the_devices_only_inside_leases(worker):
    w, rec = worker
    w.run()
    phases = leased_phases(rec.events)
    names = [e[1] for e in rec.events if e[0] == "acquire"]
    assert names == ["validate", "rollout", "train", "rollout", "train", "validate", "rollout", "train"]
    on, off = ("engines.wake_up",), ("engines.sleep", "engines.memory_report")   # what each sleep freed, reported
    assert phases[0] == [*on, "validate", *off]                    # version 0: nothing to load
    assert phases[1] == [*on, "engines.engine_stats", "generate", "engines.engine_stats", *off]
    assert phases[2] == ["trainer.onload", "train", "trainer.offload"]
    # step 2's rollout loads version 1 (the trainer comes on the device for the copy and leaves)
    assert phases[3][:4] == ["engines.wake_up", "trainer.onload", "weights.push", "trainer.offload"]
    assert phases[3][-2:] == list(off)
    # after step 2 (test_freq=2) validation loads version 2 itself, so step 3's rollout has nothing to load
    assert phases[5][:4] == ["engines.wake_up", "trainer.onload", "weights.push", "trainer.offload"]
    assert "weights.push" not in phases[6]
    assert rec.events.count(("reward",)) == 3 and w.state.step == 3


def test_the_embedded_engine_takes_the_weights_asleep_at_the_end_of_the_train_phase(worker):
    w, rec = worker
    w.loads_asleep = True   # rollout.name=hf on a pool, as SyncWorker.__init__ sets it
    w.run()
    phases = leased_phases(rec.events)
    names = [e[1] for e in rec.events if e[0] == "acquire"]
    assert names == ["validate", "rollout", "train", "rollout", "train", "validate", "rollout", "train"]
    for name, ph in zip(names, phases):
        if name == "train":   # the trainer is still on the device for the copy: no extra onload/offload
            assert ph == ["trainer.onload", "train", "weights.push", "trainer.offload"]
        else:
            assert "weights.push" not in ph and "trainer.onload" not in ph, (name, ph)
    assert w.engine_version == w.state.version == 3


def test_each_phase_reports_durations_memory_and_wait(worker):
    w, _ = worker
    w.run()
    steps = [m for step, m in w.pop_metrics() if "perf/time_per_step" in m]
    assert len(steps) == 3
    for m in steps:
        for phase in ("rollout", "train"):
            for event in ("onload", "offload"):
                assert m[f"multi_job/{phase}/{event}_s"] >= 0
                assert m[f"multi_job/{phase}/{event}/host_rss_gib_before"] > 0
                assert m[f"multi_job/{phase}/{event}/host_rss_gib_after"] > 0
            assert m[f"multi_job/{phase}/lease_wait_s"] == 0.25
    assert "multi_job/rollout/param_sync_s" not in steps[0] and "multi_job/rollout/param_sync_s" in steps[1]


@pytest.mark.parametrize("worker", ["dedicated"], indirect=True)
def test_on_its_own_devices_the_engines_and_the_trainer_hand_over_in_the_classic_order(worker):
    """No lease: the engines sleep while the trainer trains; at the end of the train phase the engines wake and take
    the new weights while the trainer is still on, and the trainer offloads (fsdp_config offload) only when the
    next rollout phase needs the devices: the order the sync loop always had."""
    w, rec = worker
    w.offload_trainer = True   # actor.fsdp_config.param_offload=true
    w.run()
    names = [e[0] for e in rec.events]
    assert "acquire" not in names
    step = ["trainer.offload", "engines.engine_stats", "generate", "engines.engine_stats", "reward",
            "engines.sleep", "engines.memory_report", "trainer.onload", "train", "engines.wake_up", "weights.push"]
    assert names[:1 + len(step)] == ["validate", *step]                 # validation before training: no switch
    assert names[1 + len(step):1 + 2 * len(step)] == step
    assert names.count("weights.push") == 3 and w.engine_version == w.state.version == 3
