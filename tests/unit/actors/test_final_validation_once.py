"""An async job on a shared pool validated its last version twice (issue 42): the trainer's last push is kept while
the rollouter is off its devices; the driver's final validation took the lease, which loaded the kept update and
validated it (test_freq) into the outbox, and then validated again for the driver.  Now each version is validated
once: counted with a fake lease, scheduler and validation function around the real Rollouter methods."""
import contextlib
import threading
from types import SimpleNamespace

import pytest

import fully_async.actors.rollouter as rollouter_mod
from fully_async.actors.rollouter import Rollouter

LAST = 4   # the trainer's last push: version 4 (= step 4)


class Lease:
    """A shared pool's lease: the update that reached the rollouter while away is loaded when it takes the lease
    (Rollouter._devices_on -> _apply_weights, which validates a version that test_freq divides)."""

    def __init__(self, rollouter, kept, validates):
        self.r, self.kept, self.validates, self.on = rollouter, kept, validates, False

    def hold(self, phase, serve=None):
        if self.on:
            return None
        self.on = True
        if self.kept is not None:
            self.r.pool.version, self.kept = self.kept, None
            if self.validates:
                self.r._validate(self.r.pool.version, resume=False)
        return {}


def rollouter(monkeypatch, version, kept=None, validates=True):
    calls = []

    def validate(pool, *args):
        calls.append(pool.version)
        return {"val-core/arithmetic/reward/mean@1": 0.5, "timing_s/testing": 0.1}

    monkeypatch.setattr(rollouter_mod, "validate", validate)
    r = Rollouter.__new__(Rollouter)
    r._init_outbox()
    r.pool = SimpleNamespace(version=version)
    r.scheduler = SimpleNamespace(park=lambda: None, resume=lambda: None)
    r.timeline = SimpleNamespace(span=lambda *a, **k: contextlib.nullcontext())
    r.trainer_state = SimpleNamespace(step_of=lambda v: v)
    r.rm_inputs, r.tokenizer, r.reward, r.val_records, r.cfg, r.tools = None, None, None, [1], None, None
    r.stats, r._published_val = {"validations": 0}, None
    r._loop_lock, r.loop_running = threading.Lock(), False
    r.residency = Lease(r, kept, validates)
    return r, calls


def test_a_kept_last_update_validated_on_loading_is_not_validated_again(monkeypatch):
    r, calls = rollouter(monkeypatch, version=LAST - 1, kept=LAST, validates=True)
    assert r.validate() is None          # the driver logs the outbox's instead
    assert calls == [LAST] and r.stats["validations"] == 1
    assert [step for step, m in r.pop_metrics()] == [LAST]


def test_a_kept_last_update_without_its_own_validation_is_validated_once_for_the_driver(monkeypatch):
    r, calls = rollouter(monkeypatch, version=LAST - 1, kept=LAST, validates=False)
    val = r.validate()
    assert val["val-core/arithmetic/reward/mean@1"] == 0.5
    assert calls == [LAST] and r.pop_metrics() == []   # on the last weights, and only for the driver


def test_an_update_that_ran_just_before_the_drivers_call_is_not_validated_again(monkeypatch):
    r, calls = rollouter(monkeypatch, version=LAST)
    r.residency.on = True
    r._validate(LAST)                    # the rollouter's own (test_freq), published
    assert r.validate() is None and calls == [LAST]


@pytest.mark.parametrize("published", [None, 3])
def test_an_older_published_version_does_not_skip_the_last(monkeypatch, published):
    r, calls = rollouter(monkeypatch, version=LAST)
    r.residency.on, r._published_val = True, published
    assert r.validate() is not None and calls == [LAST]
