"""scripts/bench_weight_sync.py: one broadcast to K receivers leaves every receiver holding the sender's weights."""
import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


@pytest.fixture
def scripts_on_path(monkeypatch):
    """The script's actors are its own classes: Ray's workers import them from scripts/."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (os.path.join(ROOT, "scripts"),
                                                                 os.environ.get("PYTHONPATH")) if p))


def test_broadcast_to_k_replicas_on_cpu(tmp_path, capsys, scripts_on_path):
    import bench_weight_sync

    out = tmp_path / "ws.json"
    assert bench_weight_sync.main(["--shapes", "tiny", "--device", "cpu", "--repeats", "1", "--replicas", "1", "2",
                                   "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["replicas"]) for r in rows] == [("collective", 1), ("collective", 2)]
    assert rows[0]["x_one_replica"] == 1.0 and rows[1]["x_one_replica"] > 0
    assert all(r["median_s"] > 0 and r["gbytes"] > 0 for r in rows)
    assert "x 1 replica" in capsys.readouterr().out


def test_receivers_start_from_other_weights():
    """The checksum tells a receiver that loaded nothing from one that loaded the sender's weights."""
    import bench_weight_sync as b
    from fully_async.device import get_device

    a, c = (b.build_model("tiny", get_device("cpu"), __import__("torch").float32) for _ in range(2))
    assert b.weights_checksum(a) != b.weights_checksum(c)
    c.load_state_dict(a.state_dict())
    assert b.weights_checksum(a) == b.weights_checksum(c)


def test_one_receiver_by_broadcast_and_by_object_store(tmp_path, scripts_on_path):
    """Without --replicas: both transports to one receiver, each leaving it with the sender's weights (the object
    store hands the receiver [ObjectRef], as the trainer hands the rollouter)."""
    import bench_weight_sync

    out = tmp_path / "ws.json"
    assert bench_weight_sync.main(["--shapes", "tiny", "--device", "cpu", "--repeats", "1", "--out", str(out)]) == 0
    assert [r["transport"] for r in json.loads(out.read_text())] == ["collective", "object_store"]
