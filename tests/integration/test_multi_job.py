"""Several independent `python -m fully_async.main` jobs share one device pool on one Ray cluster (issue #15):
they all finish and learn, their outputs stay apart, the pool's timeline shows them taking turns on the
devices (never two at once, unless their measured memory fits together: co-tenancy), a pool of another size is
refused, and a job killed mid-run (SIGKILL of its driver) loses its leases within seconds while the others finish.

Slow: every job is a `python -m fully_async.main` process of its own (~15-20 s to start; 12 of them), since the
processes are what is tested (one pool shared by separate drivers, SIGTERM and SIGKILL of a driver); the tests share
one Ray head, each with a pool of its own, the two async tests one pool and its jobs (fixture `async_pool`), and the
jobs of a test start side by side."""
import json
import os
import re
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import threading
import time

import pytest

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY = [sys.executable, "-m", "ray.scripts.scripts"]   # the ray CLI
# this machine may hold a default Ray token (~/.ray/auth_token) that `ray start` would switch on; the jobs of
# these tests run on a private head without it
ENV = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
# the pool's heartbeat timeout: the product's default.  At 3 s, job e (whose lease limit is 0.5 s) once lost its leases
# to a 3.1 s silence of its driver while the suite loaded the 2-core machine, before any phase of it could overstay
# (8fd494c's fresh-clone run); a killed job's leases are freed within it (asserted below)
HEARTBEAT_S = 5


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head (its own temp dir and port) for the module's tests, stopped by killing the process group it
    started in.  Each test's jobs use a pool of their own (`pool`), so nothing of one test is seen by the next."""
    from tests_helpers import free_ports

    # every port of its own: the suite's other worker may start a Ray head of its own meanwhile
    port, client_port, agent_port = free_ports(3)
    temp = tempfile.mkdtemp(prefix="mjray", dir="/tmp")   # short: Ray's socket paths must stay under 107 bytes
    proc = subprocess.Popen([*RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=8",
                             f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_port}",
                             f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=dict(os.environ, **ENV),
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, "ray start --head exited"
            time.sleep(0.5)
    time.sleep(2)
    yield address
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(15)
            break
        except subprocess.TimeoutExpired:
            continue
    shutil.rmtree(temp, ignore_errors=True)


POOL_WATCH = """
import json, sys, time
import ray
from fully_async.placement.device_pool import get_pool
ray.init(address=sys.argv[1], namespace="test", log_to_driver=False)
killed_at = float(sys.argv[2])
pool = get_pool(sys.argv[3])
while True:
    state = ray.get(pool.state.remote())
    if "c" not in state["jobs"]:
        break
    assert time.time() - killed_at < 10, state
    time.sleep(0.2)
print(json.dumps([state, time.time() - killed_at], default=str))
"""   # polls the pool until the killed job c is gone; prints [state, seconds since the kill]

POOLS = iter(range(1, 1000))


@pytest.fixture
def pool():
    """A device pool name of this test's own on the module's Ray head (pools are detached actors that outlive their
    jobs)."""
    return f"cpu_pool{next(POOLS)}"


RUNNING: list = []   # every Job's process, killed after its test whatever the outcome


@pytest.fixture(autouse=True)
def kill_leftover_jobs():
    yield
    kill_jobs()


def kill_jobs():
    while RUNNING:
        proc = RUNNING.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class Job:
    def __init__(self, tmp_path, address, pool, name, *overrides, mode="sync"):
        self.name, self.lines = name, []
        self.tb = tmp_path / f"tb_{name}"
        cmd = [sys.executable, "-u", "-m", "fully_async.main", f"mode={mode}", "trainer.device=cpu",
               "trainer.progress_bar=false", f"trainer.experiment_name={name}", f"multi_job.pool={pool}",
               "multi_job.devices=2", f"multi_job.heartbeat_timeout_s={HEARTBEAT_S}",
               f"multi_job.pool_dir={tmp_path}/pool",
               f"trainer.default_local_dir={tmp_path}/ckpt_{name}", f"hydra.run.dir={tmp_path}/hydra_{name}",
               *overrides]
        env = dict(os.environ, **ENV, RAY_ADDRESS=address, TENSORBOARD_DIR=str(self.tb), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=env)
        RUNNING.append(self.proc)
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    @property
    def output(self):
        return "".join(self.lines)

    def wait(self, timeout):
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def wait_for(self, pattern, timeout=400):   # a loaded 2-core machine may take minutes to start the actors
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = self.proc.poll() is not None
            if ended:
                self._reader.join(10)   # all it printed before the pattern is judged
            if re.search(pattern, self.output):
                return
            if ended:
                break
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: {pattern!r} never appeared:\n{self.output[-3000:]}")

    def summary(self):
        return json.loads((self.tb / "summary.json").read_text())


def leases(trace):
    """(job, device track, start, end, how) of every lease span in the pool's trace."""
    procs = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    return [(procs[e["pid"]], tracks[(e["pid"], e["tid"])], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
             e["args"]["how"]) for e in trace if e["ph"] == "X" and "how" in e["args"]]


def scalars(tb_dir, prefix):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [s.value for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.startswith(prefix)}


def test_two_jobs_share_the_pool_learn_and_keep_their_outputs_apart(tmp_path, ray_head, pool):
    # 8 steps: the two start side by side, and their leases must interleave (4 steps of the tiny model, ~2 s, were
    # once shorter than the two processes' start-up skew under the suite's parallel workers)
    n = 8
    steps = [f"trainer.total_training_steps={n}", "trainer.test_freq=4"]
    jobs = [Job(tmp_path, ray_head, pool, name, *steps) for name in ("a", "b")]   # both lease the whole pool
    for job in jobs:
        assert job.wait(300) == 0, job.output[-4000:]
    for job in jobs:
        s = job.summary()
        assert s["steps"] == n and s["val_after"] > s["val_before"] + 0.15, s
        assert "device pool %s: job %s leases devices [0, 1] of 2" % (pool, job.name) in job.output
        m = scalars(job.tb, "multi_job/")
        for key in ("multi_job/rollout/onload_s", "multi_job/rollout/offload_s", "multi_job/train/onload_s",
                    "multi_job/train/offload_s", "multi_job/rollout/lease_wait_s",
                    "multi_job/rollout/offload/host_rss_gib_before", "multi_job/rollout/offload/host_rss_gib_after"):
            assert len(m[key]) == n, (key, sorted(m))
        # the embedded engine takes each step's weights at the end of the train phase, asleep (no later copy)
        assert len(m["multi_job/train/param_sync_s"]) == n
        assert "multi_job/rollout/param_sync_s" not in m and "multi_job/validate/param_sync_s" not in m
        assert len(m["multi_job/validate/onload_s"]) == 3          # before training, after steps 4 and 8
    # isolated outputs: a run folder and a TensorBoard run per job, with their own config
    assert json.loads((tmp_path / "tb_a" / "config.json").read_text())["trainer"]["experiment_name"] == "a"
    assert json.loads((tmp_path / "tb_b" / "config.json").read_text())["trainer"]["experiment_name"] == "b"
    assert any(p.name.startswith("events.") for p in (tmp_path / "tb_a").iterdir())
    assert any(p.name.startswith("events.") for p in (tmp_path / "tb_b").iterdir())
    # one timeline for the pool: a process per job, a track per device; leases never overlap and alternate
    trace = json.loads((tmp_path / "pool" / pool / "timeline.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["name"] == "process_name"} == {"job a", "job b"}
    spans = sorted((s for s in leases(trace) if s[1] == "device 0"), key=lambda s: s[2])
    assert {s[0] for s in spans} == {"job a", "job b"}
    for prev, nxt in zip(spans, spans[1:]):
        assert nxt[2] >= prev[3] - 1e-3, f"two leases on device 0 at once: {prev} {nxt}"
    switches = sum(p[0] != n[0] for p, n in zip(spans, spans[1:]))
    assert switches >= 4, [(s[0], round(s[2], 2)) for s in spans]   # interleaved, not one after the other


@pytest.fixture(scope="module")
def async_pool(tmp_path_factory, ray_head):
    """Four jobs on one pool, for the two async tests: a (async: trainer on device 0, rollout on device 1), c (async:
    both sides on device 1, taking turns), b (sync: both devices per phase; far more steps than the test takes,
    validated every 6) and d (async, as a), which gets SIGTERM after its step 2 and is started again to resume; b gets
    SIGTERM once the others finished.  What each job did, once they all ended."""
    import pandas as pd

    from fully_async.core.config import asset_path

    tmp = tmp_path_factory.mktemp("async_pool")
    pool = f"cpu_pool{next(POOLS)}"
    six = ["trainer.total_training_steps=6", "trainer.test_freq=-1"]
    # d saves on SIGTERM and at the end; what it checks needs no validation
    stops = [*six, "multi_job.min_slice_s=0.2", "trainer.save_freq=1000", "data.val_files=null"]
    # b validates (every 6 steps, holding both devices while the others wait) the first 32 validation prompts: from
    # ~0.03 before training to ~0.7 at step 6 on all 128, far from the +0.15 it must gain
    val32 = tmp / "val32.parquet"
    pd.read_parquet(asset_path("tiny_arithmetic/data/val.parquet")).head(32).to_parquet(val32)
    a = Job(tmp, ray_head, pool, "a", *six, "multi_job.min_slice_s=0.3", mode="async")
    b = Job(tmp, ray_head, pool, "b", "trainer.total_training_steps=1000", "trainer.test_freq=6",
            f"data.val_files={val32}")
    c = Job(tmp, ray_head, pool, "c", *six, "multi_job.min_slice_s=0.3", "multi_job.job_devices=[1]",
            "multi_job.rollout_devices=[1]", mode="async")
    d = Job(tmp, ray_head, pool, "d", *stops, mode="async")
    try:
        return run_async_pool(tmp, ray_head, pool, stops, a, b, c, d)
    except BaseException:
        kill_jobs()   # no test's teardown has started yet: this fixture's jobs go now
        raise


def run_async_pool(tmp, ray_head, pool, stops, a, b, c, d):
    from types import SimpleNamespace

    d.wait_for(r"step 2 \|", timeout=240)
    d.proc.send_signal(signal.SIGTERM)
    out = SimpleNamespace(tmp=tmp, pool=pool, a=a, b=b, c=c, d=d, d_rc=d.wait(120))
    from fully_async.core.checkpoint import list_checkpoints
    out.d_saved = list_checkpoints(str(tmp / "ckpt_d"))
    out.again = Job(tmp, ray_head, pool, "d", *stops, mode="async")
    out.rc = {name: job.wait(300) for name, job in (("a", a), ("c", c), ("again", out.again))}
    deadline = time.monotonic() + 180   # b validated at step 6 (it may be behind the async jobs, or far past)
    while 6 not in dict(read_val(b.tb)) and b.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    out.b_ran_all_along = b.proc.poll() is None
    b.proc.send_signal(signal.SIGTERM)
    out.b_rc = b.wait(120)
    return out


def read_val(tb_dir):
    """[(step, validation reward)] of a job's TensorBoard run."""
    from tests_helpers import read_scalars

    try:
        return read_scalars(str(tb_dir)).get("val-core/arithmetic/reward/mean@1", [])
    except (KeyError, OSError):   # no event file yet
        return []


def test_async_jobs_lease_per_side_beside_a_sync_job(async_pool):
    """a (async): trainer on device 0, rollout on device 1; c (async): both sides on device 1, taking turns; b (sync):
    both devices per phase (d: the next test's).  All learn; no device ever has two holders; each side leases only its
    own devices; the rollouter parks and gives back a wanted lease, and takes weight updates while it waits."""
    jobs = async_pool
    for job in (jobs.a, jobs.c):
        assert jobs.rc[job.name] == 0, job.output[-4000:]
        s = job.summary()
        assert s["steps"] == 6 and s["val_after"] > s["val_before"] + 0.15, s
    val = dict(read_val(jobs.b.tb))   # b (many steps, 32 prompts) validated before training and after its step 6
    assert 6 in val and val[6] > val[0] + 0.15, (val, jobs.b.output[-3000:])
    assert "job a leases devices [0] (trainer) and [1] (rollout) of 2" in jobs.a.output
    assert "job c leases devices [1] (trainer) and [1] (rollout) of 2" in jobs.c.output
    for job in (jobs.a, jobs.c):
        m = scalars(job.tb, "multi_job/")
        for key in ("multi_job/train/onload_s", "multi_job/train/lease_wait_s", "multi_job/rollout/onload_s",
                    "multi_job/rollout/offload_s", "multi_job/rollout/offload/host_rss_gib_after"):
            assert m.get(key), (job.name, key, sorted(m))
        assert sum(m["multi_job/rollout/yields"]) >= 1, (job.name, m["multi_job/rollout/yields"])
    trace = json.loads((jobs.tmp / "pool" / jobs.pool / "timeline.json").read_text())["traceEvents"]
    spans = leases(trace)
    for dev in ("device 0", "device 1"):
        on = sorted((s for s in spans if s[1] == dev), key=lambda s: s[2])
        for prev, nxt in zip(on, on[1:]):
            assert nxt[2] >= prev[3] - 1e-3, f"two leases on {dev} at once: {prev} {nxt}"
    phases = {(s[0], s[1]) for s in spans}
    assert ("job a", "device 0") in phases and ("job a", "device 1") in phases
    assert ("job c", "device 0") not in phases
    procs = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    names = {(procs[e["pid"]], e["name"]) for e in trace if e.get("ph") == "X" and "how" in e["args"]}
    assert {("job a", "train"), ("job a", "rollout"), ("job c", "train"), ("job c", "rollout")} <= names


def test_async_job_on_the_pool_stops_and_resumes_losing_and_repeating_nothing(async_pool):
    """An async job (d) beside a sync one and two async ones (so its sides wait, park and stage updates): SIGTERM
    after step 2 saves a checkpoint (taken while its rollouter may hold no lease), and the restarted job resumes from
    it -- its parked responses continue at its first turn on the devices -- and trains every sample exactly once.
    The sync job b runs beside it all along (far more steps than the test takes) and stops cleanly on SIGTERM at
    the end."""
    jobs = async_pool
    assert jobs.d_rc == 128 + signal.SIGTERM, jobs.d.output[-3000:]
    assert "interrupted by SIGTERM; checkpoint:" in jobs.d.output
    saved = jobs.d_saved
    assert len(saved) == 1 and 2 <= saved[0] < 6
    again = jobs.again
    assert jobs.rc["again"] == 0, again.output[-4000:]
    assert f"resuming from {jobs.tmp}/ckpt_d/global_step_{saved[0]}" in again.output
    state = json.loads((jobs.tmp / "ckpt_d" / "global_step_6" / "trainer_state.json").read_text())
    ids = state["trained_sample_ids"]
    assert len(ids) == len(set(ids)) == 6 * 16 * 8                  # nothing trained twice, nothing lost
    assert len({i.rsplit("-s", 1)[0] for i in ids}) == 6 * 16        # each prompt once: the data position went on
    assert jobs.b_ran_all_along, jobs.b.output[-3000:]               # the sync job was there all along
    assert jobs.b_rc == 128 + signal.SIGTERM, jobs.b.output[-3000:]
    assert "interrupted by SIGTERM; checkpoint:" in jobs.b.output, jobs.b.output[-3000:]


AB_STEPS = 24


def test_killed_job_frees_its_leases_and_the_others_finish(tmp_path, ray_head, pool):
    # c leases both devices, a and b one each: c waits for both (all or nothing) and they wait for c (the pool's
    # queue is first come, first served, with no overtaking on a device): they take turns.  c must still be running
    # when it is killed, however slow the machine: far more steps than the test waits for
    c = Job(tmp_path, ray_head, pool, "c", "trainer.total_training_steps=1000", "trainer.test_freq=-1")
    # e's lease limit is shorter than its phases take on any machine (building on a slow one; on a fast one its
    # train phase, made long by 20 PPO epochs: 2 s, 4x the limit, where one epoch takes 0.1 s): revoked, and e
    # fails saying so
    overstay = Job(tmp_path, ray_head, pool, "e", "multi_job.max_lease_s=0.5", "multi_job.job_devices=[0]",
                   "actor_rollout_ref.actor.ppo_epochs=20")
    # the others start once c is in the pool (of 2 devices: d asks for 3), so that c is ahead of a and b in its queue
    # (their start-ups overlap c's actors' and e's); a and b are still running when c is killed: as soon as c trained
    # 2 steps and both of them one (d and e are judged after)
    c.wait_for(f"device pool {pool}: job c leases")
    wrong = Job(tmp_path, ray_head, pool, "d", "multi_job.devices=3", "multi_job.job_devices=[0]")
    # 24 steps each, so that both still run when the later of them has trained its first and c its second (3 steps
    # of the tiny model take ~1 s: less than their start-up skew under the suite's parallel workers; with 8, a once
    # finished first, in fe2f62f's fresh-clone run)
    a = Job(tmp_path, ray_head, pool, "a", "multi_job.job_devices=[0]", f"trainer.total_training_steps={AB_STEPS}",
            "trainer.test_freq=-1")
    b = Job(tmp_path, ray_head, pool, "b", "multi_job.job_devices=[1]", f"trainer.total_training_steps={AB_STEPS}",
            "trainer.test_freq=-1")
    c.wait_for(r"step 2 \|")
    a.wait_for(r"step 1 \|")
    b.wait_for(r"step 1 \|")
    still = {job.name: job.proc.poll() is None for job in (a, b)}
    killed_at = time.time()
    c.proc.send_signal(signal.SIGKILL)
    c.wait(30)

    # the pool is watched from a subprocess: a driver connected to this test's private head would leave Ray's
    # process-wide state (its auth mode) behind for the in-process Ray sessions of later test modules
    watch = subprocess.run([sys.executable, "-c", POOL_WATCH, ray_head, str(killed_at), pool], capture_output=True,
                           text=True, timeout=60, cwd=REPO, env=dict(os.environ, **ENV))
    assert watch.returncode == 0, watch.stdout + watch.stderr
    state, freed_after = json.loads(watch.stdout.strip().splitlines()[-1])
    assert freed_after < HEARTBEAT_S + 4, freed_after   # the heartbeat timeout (slack for a loaded CI machine)
    assert not any(h.startswith("c/") for h in state["held"]) and not any(h.startswith("c/") for h in
                                                                           state["waiting"])
    assert any("job c sent no heartbeat" in line for line in state["log"])
    assert wrong.wait(120) == 1, wrong.output[-3000:]
    assert "this pool has 2 device(s) but the job was configured for 3 (multi_job.devices)" in wrong.output
    assert "Traceback" not in wrong.output
    assert overstay.wait(180) == 1, overstay.output[-3000:]
    assert "Traceback" not in overstay.output, overstay.output[-3000:]
    assert re.search(r"sync failed( to start)?: LeaseExpired: e/colocated: lease of \[0\] for phase '\w+' "
                     r"revoked after [0-9.]+s > multi_job.max_lease_s=0.5: the phase overstayed",
                     overstay.output), overstay.output[-3000:]
    assert still == {"a": True, "b": True}, still   # c died while they ran
    for job in (a, b):
        assert job.wait(300) == 0, job.output[-4000:]
        s = job.summary()
        assert s["steps"] == AB_STEPS and s["val_after"] > s["val_before"] + 0.1, s   # they learn, as alone
    trace = json.loads((tmp_path / "pool" / pool / "timeline.json").read_text())["traceEvents"]
    lost = [s for s in leases(trace) if s[0] == "job c" and s[4] == "job lost"]
    for s in lost:  # whatever c held at its death ended on the heartbeat timeout
        assert s[3] - killed_at < 3 + 4, s
    ours = [s for s in leases(trace) if s[0] in ("job a", "job b")]
    assert {s[1] for s in ours if s[0] == "job a"} == {"device 0"}
    assert {s[1] for s in ours if s[0] == "job b"} == {"device 1"}


def test_two_jobs_whose_memory_fits_share_a_device_and_keep_their_state_on(tmp_path, ray_head, pool):
    """Co-tenancy (placement/leases.py): with a size for the logical devices, each sync job declares the memory
    model's estimate of its need from the start (the tiny model's config.json is here), raised by what it measures
    (the process's RSS on CPU); the two fit together, so their leases overlap on the device from building on, with
    nothing put off between them (kept).  Both finish and learn as alone.  24 steps: the two start side by side and
    each one's leases span ~0.15 s a step on the tiny model (4 steps, ~0.8 s, were once shorter than the start-up
    skew of the two processes under the suite's parallel workers)."""
    steps = 24
    fit = ["multi_job.job_devices=[0]", "multi_job.device_memory_gib=64", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=-1"]
    jobs = [Job(tmp_path, ray_head, pool, name, *fit) for name in ("a", "b")]
    for job in jobs:
        assert job.wait(300) == 0, job.output[-4000:]
    for job in jobs:
        s = job.summary()
        assert s["steps"] == steps and s["val_after"] > s["val_before"] + 0.1, s
        m = scalars(job.tb, "multi_job/")
        assert m["multi_job/train/shared"] == [1.0] * steps and m["multi_job/train/kept"] == [1.0] * steps, m
        assert 0 < m["multi_job/need_gib"][-1] < 64 * 0.9, m
        assert "co-tenancy: this job's estimated need" in job.output
        assert "multi_job/train/offload_s" not in m     # nothing left the device after building
    trace = json.loads((tmp_path / "pool" / pool / "timeline.json").read_text())["traceEvents"]
    spans = sorted((s for s in leases(trace) if s[1] == "device 0"), key=lambda s: s[2])
    assert any(s[4] == "kept" for s in spans)
    overlaps = [(p, n) for p, n in zip(spans, spans[1:]) if n[2] < p[3] - 1e-3 and n[0] != p[0]]
    assert overlaps, [(s[0], round(s[2], 2), round(s[3], 2), s[4]) for s in spans]
