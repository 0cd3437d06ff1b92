"""A two-node Ray cluster on one machine (two raylets, each with its own CPUs and a resource naming it): the run
joins it (RAY_ADDRESS), places trainer ranks and rollout replicas on both nodes, and finishes; a replica killed on
the second node stops the run naming it, and the run resumes from its checkpoint.

Which node hosted which actor is read from the actors' own processes: each raylet is started with FA_NODE=<name>
in its environment, which its workers inherit.

Slow: two raylets started with `ray start` for the module, and 4 runs as `python -m fully_async.main` processes
joining them (RAY_ADDRESS: a driver of its own each; one replica SIGKILLed on the second node)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def groups_alive(groups):
    alive = []
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
            alive.append(pgid)
        except ProcessLookupError:
            pass
    return alive


@pytest.fixture(scope="module")
def two_nodes():
    """`ray start --head` (node a) and `ray start --address` (node b), 2 CPUs each, each in a session of its own;
    both process groups are killed at the end."""
    temp = tempfile.mkdtemp(prefix="fa2n", dir="/tmp")  # short: Ray's socket paths live under it
    from tests_helpers import free_ports

    port, agent_port, client_port = free_ports(3)
    groups = []
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats",
              f"--dashboard-agent-listen-port={agent_port}"]
    for node, extra in (("a", ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}",
                               f"--ray-client-server-port={client_port}"]),
                        ("b", [f"--address=127.0.0.1:{port}"])):
        p = subprocess.Popen([RAY, "start", *extra, *common, f"--resources={json.dumps({f'node_{node}': 1})}"],
                             env=dict(env, FA_NODE=node), start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        groups.append(p.pid)  # a session of its own: its pid is the group of every process it starts
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    yield {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled"}
    for sig in (signal.SIGTERM, signal.SIGKILL):   # both nodes at once; up to 2 s to end on SIGTERM
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2
        while groups_alive(groups) and time.monotonic() < deadline:
            time.sleep(0.1)
    shutil.rmtree(temp, ignore_errors=True)


class Placement(threading.Thread):
    """Polls /proc while the run lasts: {(actor class, node)} of every Ray worker started by our raylets."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: dict[int, tuple[str, str]] = {}
        self.stop = threading.Event()
        self.start()

    def run(self):
        while not self.stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
                    if not title.startswith("ray::") or int(pid) in self.seen:
                        continue
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                node = next((e.decode()[len("FA_NODE="):] for e in env if e.startswith(b"FA_NODE=")), None)
                name = re.match(r"ray::(\w+)", title)
                if node and name and name.group(1) not in ("IDLE", "DashboardAgent", "RuntimeEnvAgent"):
                    self.seen[int(pid)] = (name.group(1), node)
            time.sleep(0.3)

    def nodes_of(self, actor):
        return sorted({n for a, n in self.seen.values() if a == actor})


def run_main(tmp_path, env, *overrides, timeout=240):
    cmd = [sys.executable, "-u", "-m", "fully_async.main", "trainer.progress_bar=false",
           f"hydra.run.dir={tmp_path}/hydra", f"trainer.default_local_dir={tmp_path}/ckpt", "data.val_files=null",
           *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb"), **env))


@pytest.mark.parametrize("mode,trainers,replicas,spread", [
    ("async", 3, 1, ("Trainer", "TrainWorker")), ("sync", 4, 0, ("SyncWorker", "TrainWorker"))])
def test_both_modes_span_both_nodes_and_finish(tmp_path, two_nodes, mode, trainers, replicas, spread):
    """4 devices on two 2-CPU nodes: 3 trainer ranks (FSDP2 over gloo) or 4 sync ranks (each with its engine) cannot
    fit on one.  3 rollout replicas (async, 1 trainer rank): the next test's run, which also finishes (resumed)."""
    placement = Placement()
    layout = [f"rollout.n_gpus_per_node={replicas}"] if mode == "async" else ["mode=sync"]
    r = run_main(tmp_path, two_nodes, "trainer.total_training_steps=2", f"trainer.n_gpus_per_node={trainers}",
                 *layout, "trainer.save_freq=1")
    placement.stop.set()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    state = json.loads((tmp_path / "ckpt" / "global_step_2" / "trainer_state.json").read_text())
    assert len(state["trained_sample_ids"]) == len(set(state["trained_sample_ids"])) == 2 * 16 * 8
    spread_over = {n for a, n in placement.seen.values() if a in spread}
    assert spread_over == {"a", "b"}, sorted(set(placement.seen.values()))


def test_a_replica_killed_on_the_second_node_stops_the_run_and_it_resumes(tmp_path, two_nodes):
    """Also the async layout of 1 trainer rank and 3 rollout replicas spanning both nodes and finishing (the resumed
    run) with every sample trained once."""
    placement = Placement()
    args = ["trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=3", "trainer.save_freq=1"]
    proc = subprocess.Popen([sys.executable, "-u", "-m", "fully_async.main", "trainer.progress_bar=false",
                             f"hydra.run.dir={tmp_path}/hydra", f"trainer.default_local_dir={tmp_path}/ckpt",
                             "data.val_files=null", "trainer.total_training_steps=40", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb"), **two_nodes))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 180
    while not any(re.search(r"step 2 \|", line) for line in list(lines)) and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.2)
    on_b = [pid for pid, (a, n) in placement.seen.items() if a == "EngineReplica" and n == "b"]
    assert on_b, sorted(set(placement.seen.values()))
    assert placement.nodes_of("EngineReplica") == ["a", "b"], sorted(set(placement.seen.values()))
    os.kill(on_b[0], signal.SIGKILL)
    assert proc.wait(120) == 1, "".join(lines)[-3000:]
    placement.stop.set()
    out = "".join(lines)
    assert re.search(r"(engine|replica|rollouter)\S* failed", out, re.I), out[-3000:]
    from fully_async.core.checkpoint import list_checkpoints
    saved = list_checkpoints(str(tmp_path / "ckpt"))[-1]
    assert saved >= 2
    r = run_main(tmp_path, two_nodes, f"trainer.total_training_steps={saved + 2}", *args)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"resuming from {tmp_path}/ckpt/global_step_{saved}" in r.stdout + r.stderr
    state = json.loads((tmp_path / "ckpt" / f"global_step_{saved + 2}" / "trainer_state.json").read_text())
    assert len(state["trained_sample_ids"]) == len(set(state["trained_sample_ids"])) == (saved + 2) * 16 * 8
