"""Which process holds a connection to which port: how the session tests see which carrier a hop took."""

from __future__ import annotations

import psutil


def holds_connection(pid: int, address: str) -> bool:
    """Whether process `pid` holds an established TCP connection to `address`'s port ("host:port")."""
    port = int(address.rsplit(":", 1)[1])
    return any(
        c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        for c in psutil.Process(pid).net_connections("tcp")
    )
