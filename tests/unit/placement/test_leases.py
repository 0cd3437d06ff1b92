"""The device pool's lease rules on a fake clock: FIFO without overtaking, all-or-nothing, one lease per holder,
expiry of overstayed leases, release on owner death, and a randomized many-job simulation (no deadlock, no
starvation, never two holders on one device)."""
import random

import pytest

from fully_async.placement.leases import LeaseBook, LeaseError, LeaseExpired


def book(devices=2, hold=10.0, hb=3.0, jobs=("a", "b", "c", "d")):
    b = LeaseBook(devices, hold, hb)
    for j in jobs:
        b.register(j, devices, 0.0)
    return b


def test_fifo_order_on_a_shared_device():
    b = book()
    for t, j in enumerate("abc"):
        b.request(j, f"{j}/x", "train", [0], float(t))
    assert b.holders() == {"a/x": [0]} and b.waiting_holders() == ["b/x", "c/x"]
    b.release("a", "a/x", 3.0)
    assert b.holders() == {"b/x": [0]}
    b.request("a", "a/x", "rollout", [0], 3.5)   # a comes back: behind c
    b.release("b", "b/x", 4.0)
    assert b.holders() == {"c/x": [0]} and b.waiting_holders() == ["a/x"]


def test_all_or_nothing_and_no_overtaking_on_shared_devices():
    b = book(devices=3)
    b.request("a", "a/x", "train", [0], 0.0)
    b.request("b", "b/x", "train", [0, 1], 1.0)      # device 1 is free but 0 is not: b holds neither
    assert b.holders() == {"a/x": [0]} and 1 not in b.owners
    b.request("c", "c/x", "train", [1], 2.0)         # would fit, but b asked for device 1 first
    assert "c/x" in b.waiting_holders()
    b.request("d", "d/x", "train", [2], 3.0)         # disjoint from everyone waiting: goes ahead
    assert b.holders() == {"a/x": [0], "d/x": [2]}
    b.release("a", "a/x", 4.0)
    assert b.holders() == {"b/x": [0, 1], "d/x": [2]} and b.waiting_holders() == ["c/x"]
    b.release("b", "b/x", 5.0)
    assert b.holders() == {"c/x": [1], "d/x": [2]}


def test_one_lease_per_holder_and_bad_requests():
    b = book()
    b.request("a", "a/x", "train", [0], 0.0)
    with pytest.raises(LeaseError, match="second lease"):
        b.request("a", "a/x", "rollout", [1], 0.5)
    b.request("b", "b/x", "train", [0], 0.5)
    with pytest.raises(LeaseError, match="second lease"):      # waiting counts as well
        b.request("b", "b/x", "train", [1], 0.6)
    b.request("a", "a/y", "train", [1], 0.7)                    # another side of the same job is another holder
    assert b.holders() == {"a/x": [0], "a/y": [1]}
    with pytest.raises(LeaseError, match="subset"):
        b.request("c", "c/x", "train", [2], 1.0)
    with pytest.raises(LeaseError, match="does not hold"):
        b.release("c", "c/x", 1.0)
    with pytest.raises(LeaseError, match="not registered"):
        b.request("zz", "zz/x", "train", [0], 1.0)


def test_registration_checks_device_count_and_live_names():
    b = LeaseBook(2, 10.0, 3.0)
    b.register("a", 2, 0.0)
    with pytest.raises(LeaseError, match=r"this pool has 2 device\(s\) but the job was configured for 4"):
        b.register("b", 4, 0.0)
    with pytest.raises(LeaseError, match="live job named 'a'"):
        b.register("a", 2, 1.0)
    b.register("a", 2, 10.0)   # the old 'a' stopped heartbeating long ago: the name is free again


def test_overstayed_lease_is_revoked_and_the_holder_told():
    b = book(hold=10.0, hb=100.0)
    b.request("a", "a/x", "train", [0, 1], 0.0)
    b.request("b", "b/x", "rollout", [1], 1.0)
    assert b.tick(9.0) == [] and b.holders() == {"a/x": [0, 1]}
    done = b.tick(10.5)
    assert len(done) == 1 and "multi_job.max_lease_s=10" in done[0]
    assert b.holders() == {"b/x": [1]}                 # the next in line got the device at once
    with pytest.raises(LeaseExpired, match=r"revoked after 10.5s > multi_job.max_lease_s=10"):
        b.release("a", "a/x", 11.0)
    b.request("a", "a/x", "train", [0], 12.0)           # told once; the job may go on if it chooses to
    assert b.holders() == {"a/x": [0], "b/x": [1]}
    ends = [(e.job, e.track, e.args.get("how")) for e in b.drain_events() if e.track.startswith("device")]
    assert ("a", "device 0", "revoked") in ends and ("a", "device 1", "revoked") in ends


def test_a_job_that_stops_heartbeating_loses_its_leases_and_place():
    b = book(hb=3.0, jobs=("a", "b", "c"))
    b.request("a", "a/x", "train", [0], 0.0)
    b.request("b", "b/x", "train", [0], 0.5)
    b.request("a", "a/y", "rollout", [1], 0.6)
    b.request("c", "c/x", "train", [1], 0.7)
    for t in (1.0, 2.0, 3.0):
        b.heartbeat("b", t)
        b.heartbeat("c", t)
        b.tick(t)
    assert b.holders() == {"a/x": [0], "a/y": [1]}
    done = b.tick(3.7)  # a silent since 0.6
    assert any("job a sent no heartbeat" in line for line in done)
    assert b.holders() == {"b/x": [0], "c/x": [1]} and "a" not in b.jobs
    with pytest.raises(LeaseExpired, match="no heartbeat"):
        b.release("a", "a/x", 4.0)
    with pytest.raises(LeaseExpired, match="no heartbeat"):
        b.heartbeat("a", 4.0)


def test_unregister_gives_everything_back():
    b = book()
    b.request("a", "a/x", "train", [0, 1], 0.0)
    b.request("a", "a/y", "train", [0], 0.1)
    b.request("b", "b/x", "train", [1], 0.2)
    b.unregister("a", 1.0)
    assert b.holders() == {"b/x": [1]} and b.waiting_holders() == []


@pytest.mark.parametrize("seed", range(5))
def test_randomized_many_jobs_no_deadlock_no_starvation(seed):
    """40 simulated jobs on 4 devices: random device sets (1-4), random phase lengths, some phases overstay,
    some jobs die holding a lease.  Every living job finishes all its phases, every wait stays under the
    FIFO bound, and no device ever has two holders."""
    rng = random.Random(seed)
    n_dev, hold, hb, dt, phases = 4, 5.0, 1.0, 0.05, 6
    b = LeaseBook(n_dev, hold, hb)
    jobs = {f"j{i}": {"state": "idle", "until": rng.uniform(0, 2), "done": 0, "dies_at": None,
                      "devs": None, "asked": 0.0} for i in range(40)}
    for name in rng.sample(sorted(jobs), 4):
        jobs[name]["dies_at"] = rng.uniform(1, 30)
    for name in jobs:
        b.register(name, n_dev, 0.0)
    t, max_wait, revoked, bound = 0.0, 0.0, 0, (len(jobs) + 1) * hold + hb + 1.0
    while any(j["done"] < phases and j["dies_at"] is None for j in jobs.values()):
        t += dt
        assert t < 2000, f"not finished by t={t}: {b.holders()} waiting {b.waiting_holders()}"
        b.tick(t)
        owners = {}
        for holder, devs in b.holders().items():
            for d in devs:
                assert d not in owners, f"device {d} held by {owners[d]} and {holder}"
                owners[d] = holder
        for name, j in jobs.items():
            dead = j["dies_at"] is not None and t >= j["dies_at"]
            if dead or j["done"] >= phases:
                continue
            b.heartbeat(name, t)
            holder = f"{name}/x"
            if j["state"] == "idle" and t >= j["until"]:
                j["devs"] = rng.sample(range(n_dev), rng.randint(1, n_dev))
                b.request(name, holder, rng.choice(["rollout", "train"]), j["devs"], t)
                j["state"], j["asked"] = "waiting", t
            if j["state"] == "waiting" and b.granted(name, holder) is not None:
                max_wait = max(max_wait, t - j["asked"])
                overstay = rng.random() < 0.05
                j["state"], j["until"] = "holding", t + (hold * 1.5 if overstay else rng.uniform(0.05, 1.0))
            elif j["state"] == "holding" and t >= j["until"]:
                try:
                    b.release(name, holder, t)
                except LeaseExpired:
                    revoked += 1
                j["state"], j["until"], j["done"] = "idle", t + rng.uniform(0, 0.5), j["done"] + 1
        for name, j in jobs.items():
            if j["dies_at"] is not None and t >= j["dies_at"] + hb + 2 * dt:
                assert name not in b.jobs and not any(h.startswith(f"{name}/") for h in b.holders())
    assert max_wait <= bound, (max_wait, bound)
    assert revoked > 0  # the overstays were exercised


def test_each_job_has_its_own_time_limit():
    b = LeaseBook(2, 100.0, 1000.0)
    b.register("short", 2, 0.0, max_hold_s=1.0)
    b.register("long", 2, 0.0)
    b.request("short", "short/x", "train", [0], 0.0)
    b.request("long", "long/x", "train", [1], 0.0)
    assert len(b.tick(1.5)) == 1 and b.holders() == {"long/x": [1]}
    with pytest.raises(LeaseExpired, match="multi_job.max_lease_s=1:"):
        b.release("short", "short/x", 2.0)
    assert b.tick(99.0) == [] and b.tick(100.5) != []


def test_an_async_job_holds_two_leases_one_per_side_and_renews_only_uncontended():
    b = book(hold=5.0, hb=100.0)
    b.request("a", "a/train", "train", [0], 0.0)
    b.request("a", "a/rollout", "rollout", [1], 0.0)          # the other side of the same job: its own lease
    assert b.holders() == {"a/train": [0], "a/rollout": [1]}
    assert b.renew("a", "a/train", 4.0) is False               # nobody wants [0]: the limit restarts
    assert b.renew("a", "a/rollout", 4.0) is False
    b.tick(8.0)
    assert "a/train" in b.holders()                            # 8 s held, but renewed at 4 s (limit 5 s)
    b.request("b", "b/train", "train", [0, 1], 8.5)            # wants both: both of a's leases are contended
    assert b.contended("a/train") and b.contended("a/rollout") and not b.contended("b/train")
    assert b.renew("a", "a/train", 8.6) is True                # contended: the deadline stays at 4 + 5
    b.release("a", "a/rollout", 8.8)                           # the rollout side gives its lease back
    assert b.holders() == {"a/train": [0]}                     # b waits for both (all or nothing)
    b.tick(9.1)
    assert b.holders() == {"b/train": [0, 1]}                  # a/train revoked: renewing cannot keep a wanted lease
    with pytest.raises(LeaseExpired, match="overstayed"):
        b.renew("a", "a/train", 9.2)
    with pytest.raises(LeaseError, match="does not hold"):
        b.renew("a", "a/rollout", 9.4)


# ---------------------------------------------------------------------------------------------- co-tenancy
def cobook(cap=100.0, devices=1, jobs=("a", "b", "c"), co_tenancy=True):
    b = LeaseBook(devices, 100.0, 1000.0, co_tenancy=co_tenancy)   # usable: 100 - max(2, 10%) = 90 GiB
    for j in jobs:
        b.register(j, devices, 0.0)
    return b


def test_holders_whose_needs_fit_share_a_device_and_the_rest_waits():
    b = cobook()
    b.request("a", "a/x", "rollout", [0], 0.0, need_gib=40, capacity_gib=100)
    b.request("b", "b/x", "rollout", [0], 0.1, need_gib=45, capacity_gib=100)     # 85 <= 90: together
    assert b.holders() == {"a/x": [0], "b/x": [0]} and b.shared_now("a/x") and b.shared_now("b/x")
    b.request("c", "c/x", "train", [0], 0.2, need_gib=10, capacity_gib=100)       # 95 > 90: waits
    assert b.waiting_holders() == ["c/x"]
    b.release("a", "a/x", 1.0)
    assert b.holders() == {"b/x": [0], "c/x": [0]}
    assert b.memory()[0]["held"] == {"b/x": 45, "c/x": 10} and b.memory()[0]["usable_gib"] == 90


def test_an_unmeasured_request_takes_the_device_alone_and_blocks_the_measured_ones():
    b = cobook()
    b.request("a", "a/x", "setup", [0], 0.0, capacity_gib=100)                    # no need: alone
    b.request("b", "b/x", "rollout", [0], 0.1, need_gib=1, capacity_gib=100)
    assert b.holders() == {"a/x": [0]} and not b.shared_now("a/x")
    b.release("a", "a/x", 1.0)
    b.request("a", "a/x", "setup", [0], 1.1)                                      # waits for b to go
    assert b.holders() == {"b/x": [0]} and b.waiting_holders() == ["a/x"]
    b.release("b", "b/x", 2.0)
    assert b.holders() == {"a/x": [0]}


def test_kept_state_counts_until_dropped_and_is_asked_off_when_a_request_needs_the_room():
    b = cobook()
    b.request("a", "a/x", "rollout", [0], 0.0, need_gib=50, capacity_gib=100)
    assert b.keep("a", "a/x", 50, 0.5)                     # nobody waits: a's state may stay on
    b.release("a", "a/x", 1.0)
    assert b.memory()[0]["kept"] == {"a/x": 50} and not b.holders()
    b.request("b", "b/x", "rollout", [0], 1.1, need_gib=30, capacity_gib=100)     # 80 fits beside the kept 50
    assert b.holders() == {"b/x": [0]} and not b.must_drop("a/x")
    assert b.keep("b", "b/x", 30, 1.5)                     # nobody waits: b may keep too
    b.release("b", "b/x", 2.0)
    b.request("c", "c/x", "train", [0], 2.1, need_gib=60, capacity_gib=100)       # 50 + 30 + 60 > 90
    assert b.waiting_holders() == ["c/x"] and b.must_drop("a/x") and b.must_drop("b/x")
    b.kept_dropped("a", "a/x", 2.5)                        # 30 + 60 fits: c goes beside b's kept 30
    assert b.holders() == {"c/x": [0]} and not b.must_drop("b/x") and b.memory()[0]["kept"] == {"b/x": 30}
    ends = [e.args.get("how") for e in b.drain_events() if e.track == "device 0"]
    assert ends[:2] == ["kept", "kept"]


def test_a_kept_holder_coming_back_is_granted_over_its_own_state_and_keep_is_refused_when_someone_waits():
    b = cobook()
    b.request("a", "a/x", "rollout", [0], 0.0, need_gib=80, capacity_gib=100)
    assert b.keep("a", "a/x", 80, 0.5)
    b.release("a", "a/x", 1.0)
    b.request("a", "a/x", "train", [0], 1.1, need_gib=80)          # its own kept 80 does not block it
    assert b.holders() == {"a/x": [0]} and b.memory()[0]["kept"] == {}
    b.request("b", "b/x", "train", [0], 1.2, need_gib=20, capacity_gib=100)       # 100 > 90: waits
    assert not b.keep("a", "a/x", 80, 1.5)                          # someone waits: the state goes off
    b.release("a", "a/x", 2.0)
    assert b.holders() == {"b/x": [0]}


def test_co_tenancy_off_or_an_unknown_capacity_means_one_holder_at_a_time():
    for b, cap in ((cobook(co_tenancy=False), 100.0), (cobook(), None)):
        b.request("a", "a/x", "rollout", [0], 0.0, need_gib=1, capacity_gib=cap)
        b.request("b", "b/x", "rollout", [0], 0.1, need_gib=1, capacity_gib=cap)
        assert b.holders() == {"a/x": [0]}
        assert not b.keep("a", "a/x", 1, 0.5)
    with pytest.raises(LeaseError, match="positive number of GiB"):
        cobook().request("a", "a/x", "rollout", [0], 0.0, need_gib=0)


def test_a_dead_jobs_kept_state_is_forgotten():
    b = LeaseBook(1, 100.0, 3.0)
    for j in "ab":
        b.register(j, 1, 0.0)
    b.request("a", "a/x", "rollout", [0], 0.0, need_gib=80, capacity_gib=100)
    assert b.keep("a", "a/x", 80, 0.5)
    b.release("a", "a/x", 1.0)
    b.request("b", "b/x", "rollout", [0], 1.0, need_gib=50, capacity_gib=100)
    assert b.must_drop("a/x") and not b.holders()
    b.heartbeat("b", 3.0)
    b.tick(4.5)                                             # a silent since 1.0: its process (and memory) are gone
    assert b.holders() == {"b/x": [0]} and not b.kept


@pytest.mark.parametrize("seed", range(3))
def test_randomized_co_tenants_never_overfill_a_device_and_all_finish(seed):
    """12 jobs on 2 devices of 100 GiB with random needs (some unmeasured), random phases, keeping their state when
    allowed and dropping it when asked at their next request: the declared memory on a device never passes its
    usable 90 GiB (an unmeasured holder is always alone), and every job finishes."""
    rng = random.Random(seed)
    b = LeaseBook(2, 50.0, 1000.0)
    jobs = {f"j{i}": {"state": "idle", "until": rng.uniform(0, 1), "done": 0, "need": rng.choice([None, 10, 30, 60]),
                      "devs": None} for i in range(12)}
    for name in jobs:
        b.register(name, 2, 0.0)
    t, shared_seen = 0.0, 0
    while any(j["done"] < 5 for j in jobs.values()):
        t += 0.05
        assert t < 1000, (b.holders(), b.waiting_holders(), b.memory())
        for d, mem in b.memory().items():
            held, kept = mem["held"], mem["kept"]
            if any(g is None for g in held.values()):
                assert len(held) + len(kept) == 1, mem
            else:
                assert sum(held.values()) + sum(kept.values()) <= 90 + 1e-9, mem
            shared_seen += len(held) > 1
        for name, j in jobs.items():
            holder = f"{name}/x"
            if j["done"] >= 5:
                continue
            if b.must_drop(holder):
                b.kept_dropped(name, holder, t)
            if j["state"] == "idle" and t >= j["until"]:
                j["devs"] = rng.sample(range(2), rng.randint(1, 2))
                b.request(name, holder, "p", j["devs"], t, need_gib=j["need"], capacity_gib=100)
                j["state"] = "waiting"
            if j["state"] == "waiting" and b.granted(name, holder) is not None:
                j["state"], j["until"] = "holding", t + rng.uniform(0.05, 0.5)
            elif j["state"] == "holding" and t >= j["until"]:
                if j["need"] is not None and rng.random() < 0.5:
                    b.keep(name, holder, j["need"], t)
                b.release(name, holder, t)
                j["state"], j["until"], j["done"] = "idle", t + rng.uniform(0, 0.3), j["done"] + 1
                if j["done"] >= 5 and holder in b.kept:
                    b.kept_dropped(name, holder, t)
    assert shared_seen > 0
