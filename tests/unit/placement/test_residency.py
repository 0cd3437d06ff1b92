"""The residency collaborator (placement/residency.py): when a side's on/off transitions run, what a pool lease keeps,
and that no loop is varied by subclassing any more."""
import ast
import contextlib
import os

from fully_async.placement.residency import Dedicated, Elastic, PoolLease, Stopped, Turns


class FakeClient:
    """A LeaseClient stand-in: `waiting` says whether another holder wants the devices."""

    def __init__(self, waiting=False, share=False):
        self.current, self.polls, self.waiting, self.log = None, 0, waiting, []
        self.share = share                      # the pool shares memory: a declared need is granted "shared"
        self.need_gib = self.capacity_gib = self.on_drop = None

    def keep(self, gib):
        self.log.append(("keep", gib))
        return self.share and not self.waiting

    def acquire(self, name, serve=None):
        self.polls += 1
        if serve is not None:
            serve()
        ph = type("Ph", (), {"waited_s": 0.5, "name": name, "spans": [],
                             "shared": self.share and self.need_gib is not None})()

        @contextlib.contextmanager
        def span(n, **args):
            yield dict(args)
        ph.span = span
        self.current = ph
        self.log.append(("acquire", name))
        return ph

    def renew(self):
        return self.waiting

    def release(self, failing=False):
        self.log.append(("release", self.current.name))
        self.current = None

    @contextlib.contextmanager
    def phase(self, name):
        ph = self.acquire(name)
        try:
            yield ph
        finally:
            self.release()


def attached(residency, log):
    residency.attach(on=lambda ph, phase: log.append(("on", phase)) or {"on": 1.0},
                     off=lambda ph, why: log.append(("off", why)) or {"off": 1.0})
    return residency


def test_dedicated_devices_are_always_held_and_never_switch():
    log = []
    r = attached(Dedicated(), log)
    with r.setup():
        pass
    assert r.hold("rollout") == {} and r.holding and not r.wanted() and r.give_back("done") == {}
    assert not r.keep(("load", 3)) and r.take_kept() is None and not r.has_kept()
    assert log == [] and r.polls == 0


def test_a_pool_lease_puts_the_state_on_only_while_held_and_keeps_updates_meanwhile():
    log, client = [], FakeClient()
    r = attached(PoolLease(client), log)
    with r.setup():
        log.append(("build",))
    assert log == [("build",), ("off", "setup")] and not r.holding
    assert r.keep(("load", 1)) and r.keep(("load", 2)) and r.has_kept()   # the newest wins
    assert r.hold("rollout") == {"on": 1.0} and r.holding
    assert r.hold("rollout") == {}                                        # held and on already
    assert r.take_kept() == ("load", 2) and r.take_kept() is None
    assert not r.keep(("load", 3))                                        # on the devices: load now
    assert not r.wanted()                                                 # nobody waits
    client.waiting = True
    assert r.wanted() and not r.wanted(min_held_s=3600)                   # wanted, but not held long enough
    assert r.give_back("wanted") == {"off": 1.0} and not r.holding
    assert r.pop_metrics() == {"off": 1.0, "on": 1.0} and r.pop_metrics() == {}
    assert ("off", "wanted") in log and client.log[-1] == ("release", "rollout")


def test_a_stop_while_waiting_for_the_lease_is_no_hold():
    def serve():
        raise Stopped()
    r = attached(PoolLease(FakeClient()), [])
    assert r.hold("rollout", serve=serve) is None


def test_turns_switch_tenants_and_on_a_pool_both_leave_with_the_lease():
    log = []

    def tenant(name):
        return (lambda ph, phase: log.append((name, "on", phase)) or {},
                lambda ph, phase: log.append((name, "off", phase)) or {})
    own = Turns(Dedicated(), engines=tenant("engines"), trainer=tenant("trainer"))
    with own.phase("engines", "rollout"):
        pass
    with own.phase("trainer", "train"):
        pass
    assert log == [("trainer", "off", "rollout"), ("engines", "off", "train"), ("trainer", "on", "train")]
    log.clear()
    pool = Turns(PoolLease(FakeClient()), engines=tenant("engines"), trainer=tenant("trainer"))
    with pool.setup():
        pass
    with pool.phase("engines", "rollout") as (ph, switch):
        assert switch["multi_job/rollout/lease_wait_s"] == 0.5
    assert log == [("engines", "off", "setup"), ("trainer", "off", "setup"), ("engines", "on", "rollout"),
                   ("engines", "off", "rollout")]


def test_turns_on_a_pool_that_shares_memory_measure_then_declare_then_keep_both_tenants_on(caplog):
    """A job's first rollout and train phases are measured one tenant at a time (alone on the device); their sum is
    the need it declares; a lease granted on it switches nothing and keeps the state on between leases, until the
    pool asks for it off (on_drop) or someone waits at the end of a phase."""
    log, held = [], {"rollout": 10.0, "train": 20.0}

    def tenant(name):
        return (lambda ph, phase: log.append((name, "on", phase)) or {},
                lambda ph, phase: log.append((name, "off", phase)) or {})
    client = FakeClient(share=True)
    turns = Turns(PoolLease(client), engines=tenant("engines"), trainer=tenant("trainer"),
                  measure=lambda kind: (held[kind], 100.0))
    with turns.setup():
        pass
    log.clear()
    with turns.phase("engines", "rollout") as (_, m):
        pass
    assert client.need_gib is None and m["multi_job/rollout/shared"] == 0.0    # one tenant measured so far
    with turns.phase("trainer", "train") as (_, m):
        pass
    assert client.need_gib == 30.0 and client.capacity_gib == 100.0 and m["multi_job/train/kept"] == 0.0
    assert log == [("engines", "on", "rollout"), ("engines", "off", "rollout"), ("trainer", "on", "train"),
                   ("trainer", "off", "train")]
    log.clear()
    held["rollout"] = 29.0      # both tenants on: the need itself is measured (it only grows)
    with turns.phase("engines", "rollout") as (_, m):
        pass
    with turns.phase("trainer", "train") as (_, m):
        pass
    with turns.phase("engines", "rollout") as (_, m):
        pass
    assert log == [("engines", "on", "rollout"), ("trainer", "on", "train")]   # then nothing moves
    assert m["multi_job/rollout/shared"] == 1.0 and m["multi_job/rollout/kept"] == 1.0 and turns.kept
    assert client.need_gib == 30.0 and turns.counts == {"shared": 3, "kept": 3, "dropped": 0}
    held["train"] = 36.0        # grown past what it declared while sharing: said, and declared from now on
    with caplog.at_level("WARNING", logger="fully_async.placement.residency"):
        with turns.phase("trainer", "train"):
            pass
    assert client.need_gib == 36.0 and "more than the 30.0 it declared" in caplog.text
    log.clear()
    client.on_drop(None)        # another job's request needs the room: the kept state goes off
    assert log == [("engines", "off", "drop"), ("trainer", "off", "drop")] and not turns.kept
    log.clear()
    client.waiting = True       # someone waits as the phase ends: the state goes off with the lease
    with turns.phase("trainer", "train") as (_, m):
        pass
    assert log == [("trainer", "on", "train"), ("trainer", "off", "train")] and m["multi_job/train/kept"] == 0.0


def test_elastic_lends_the_engines_while_the_trainer_waits_and_reclaims_them_for_its_work():
    """The trainer's loop calls wanted/give_back while it waits and hold before it works (trainer.py): the engines
    are lent exactly while it waits, and a step's metrics carry the lend before it with the reclaim."""
    log = []
    el = Elastic(lend=lambda ph, phase: log.append(("lend", phase)) or {"lend_s": 1.0},
                 reclaim=lambda ph, phase: log.append(("reclaim", phase)) or {"parked": 3.0})
    attached(el, log)                        # the trainer stays on its devices: its own transitions never run
    with el.setup():
        pass
    assert el.hold("train") == {} and el.wanted() and el.poll_s == 0.05 and not el.lent
    assert el.give_back("waiting") == {} and el.lent and not el.wanted() and el.poll_s == 0.5
    assert el.give_back("waiting") == {}     # lent already: nothing runs again
    assert el.hold("train") == {"lend_s": 1.0, "parked": 3.0} and not el.lent
    assert el.hold("train") == {}            # held already (a save, the weight push)
    el.give_back("wanted")
    assert el.give_back("done") == {"lend_s": 1.0, "parked": 3.0}   # the run ends: reclaimed for good
    assert log == [("lend", "waiting"), ("reclaim", "train"), ("lend", "wanted"), ("reclaim", "done")]
    assert not el.keep("update") and el.take_kept() is None and el.pop_metrics() == {}


def test_no_loop_is_varied_by_a_subclass():
    """Variants are collaborators: no class of the package subclasses the rollouter, the trainer or the sync worker."""
    pkg = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fully_async")
    loops = {"Rollouter", "Trainer", "SyncWorker"}
    bad = []
    for root, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(root, f)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                        if bases & loops:
                            bad.append(f"{f}:{node.name}")
    assert bad == []


def test_a_declared_estimate_lets_building_keep_both_tenants_on():
    """An estimated need declared before building: the setup lease is granted on it, and the built state stays on
    (kept) instead of going off; without a share (or with someone waiting) it goes off as before."""
    log = []

    def tenant(name):
        return (lambda ph, phase: log.append((name, "on", phase)) or {},
                lambda ph, phase: log.append((name, "off", phase)) or {})
    client = FakeClient(share=True)
    turns = Turns(PoolLease(client), engines=tenant("engines"), trainer=tenant("trainer"),
                  measure=lambda kind: (5.0, 100.0))
    turns.declare(12.0, 100.0)
    with turns.setup():
        pass
    assert log == [] and turns.kept and ("keep", 12.0) in client.log
    with turns.phase("trainer", "train") as (_, m):
        pass
    assert log == [] and client.need_gib == 12.0     # measured 5 GiB: the estimate stays the floor
    plain = Turns(PoolLease(FakeClient()), engines=tenant("engines"), trainer=tenant("trainer"))
    plain.declare(12.0, 100.0)
    with plain.setup():
        pass
    assert log == [("engines", "off", "setup"), ("trainer", "off", "setup")] and not plain.kept


def test_running_out_of_memory_while_sharing_names_co_tenancy_and_how_to_take_turns():
    import pytest
    import torch

    from fully_async.cluster.ray_utils import RunFailed

    client = FakeClient(share=True)
    nothing = (lambda ph, phase: {}, lambda ph, phase: {})
    turns = Turns(PoolLease(client), engines=nothing, trainer=nothing, measure=lambda kind: (5.0, 100.0))
    turns.declare(12.0, 100.0)
    with pytest.raises(RunFailed, match=r"in the train phase while this job shared it .*declared 12.0 GiB of the "
                                        r"device's 100.0.*multi_job.co_tenancy=false") as err:
        with turns.phase("trainer", "train"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    alone = Turns(PoolLease(FakeClient()), engines=nothing, trainer=nothing)
    with pytest.raises(torch.OutOfMemoryError):        # not shared: the allocator's own error, unchanged
        with alone.phase("trainer", "train"):
            raise torch.OutOfMemoryError("CUDA out of memory")
