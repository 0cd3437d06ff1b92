"""Rank 0's rendezvous port is picked by the OS and stays bound from the moment it is chosen, so another job on
the same node cannot take it before the trainer ranks connect (several jobs sharing a device pool)."""
import socket

from fully_async.train.backends.fsdp import master_store


def test_port_is_held_from_the_start_and_distinct_per_job():
    a, b = master_store("127.0.0.1", 2), master_store("127.0.0.1", 2)
    assert a.port != b.port and a.port > 0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        try:
            s.bind(("", a.port))
            taken = False
        except OSError:
            taken = True
    assert taken, f"port {a.port} was free to bind: another job could have taken it"
    a.set("k", "v")
    assert a.get("k") == b"v"
