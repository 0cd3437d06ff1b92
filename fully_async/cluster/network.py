"""Addresses for the stateless process groups (trainer ranks, trainer -> engines broadcast)."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"
