"""A second "host" for partition tests: a network namespace joined to the root namespace by a veth pair.

    reason = netns_unavailable()              # None, or why the kernel refuses (not root, no netns support)
    async with NetnsHost() as host:           # root side host.gateway_ip, namespace side host.ip (a /30)
        proc = MeshllmProcess("worker", "--host", host.ip, ..., prefix=host.exec_prefix)
        await host.partition()                # both ends of the link down: nothing passes, nothing is closed
        await host.heal()

Names and the 10.213.x.y/30 subnet are random per host, so parallel test runs
do not collide. A partition takes both ends of the link down, as pulling the
cable between two hosts would; established TCP connections stay open on both
sides and resume (by retransmission) when the link comes back. Closing
deletes the namespace and the veth pair; it is idempotent. Needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` tool.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess

from meshllm.lifecycle import AsyncCloseable

__all__ = ["NetnsHost", "netns_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    return subprocess.run([ip, *args], capture_output=True, text=True, check=check, timeout=10)


def netns_unavailable() -> str | None:
    """None when a namespace with a veth pair can be made here, else the reason (the kernel's or the tool's)."""
    name = f"mlprobe{random.randrange(1 << 24):06x}"
    try:
        probe = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the `ip` tool (iproute2) is not installed"
    if probe.returncode != 0:
        return f"`ip netns add` refused: {probe.stderr.strip()}"
    try:
        run = _ip("netns", "exec", name, "true", check=False)
        if run.returncode != 0:
            return f"`ip netns exec` refused: {run.stderr.strip()}"
        veth = _ip("link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b", check=False)
        if veth.returncode != 0:
            return f"`ip link add ... type veth` refused: {veth.stderr.strip()}"
        _ip("link", "del", f"{name}a", check=False)
    finally:
        _ip("netns", "del", name, check=False)
    return None


class NetnsHost(AsyncCloseable):
    """A namespace `name` whose veth end has `ip`; the root namespace's end has `gateway_ip`."""

    def __init__(self) -> None:
        tag = f"{random.randrange(1 << 24):06x}"
        self.name = f"mlf{tag}"
        self.root_link, self.ns_link = f"mlf{tag}a", f"mlf{tag}b"  # interface names: at most 15 characters
        subnet = random.randrange(1 << 14) * 4  # a /30 inside 10.213.0.0/16
        self.gateway_ip = f"10.213.{subnet >> 8}.{(subnet & 255) + 1}"
        self.ip = f"10.213.{subnet >> 8}.{(subnet & 255) + 2}"
        self._created = False

    @property
    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return [shutil.which("ip") or "/usr/sbin/ip", "netns", "exec", self.name]

    async def __aenter__(self) -> NetnsHost:
        await asyncio.to_thread(self._create)
        return self

    def _create(self) -> None:
        _ip("netns", "add", self.name)
        self._created = True
        _ip("link", "add", self.root_link, "type", "veth", "peer", "name", self.ns_link)
        _ip("link", "set", self.ns_link, "netns", self.name)
        _ip("addr", "add", f"{self.gateway_ip}/30", "dev", self.root_link)
        _ip("-n", self.name, "addr", "add", f"{self.ip}/30", "dev", self.ns_link)
        _ip("-n", self.name, "link", "set", "lo", "up")
        self._set_links("up")

    def _set_links(self, state: str) -> None:
        _ip("link", "set", self.root_link, state)
        _ip("-n", self.name, "link", "set", self.ns_link, state)

    async def partition(self) -> None:
        """Take both ends of the link down."""
        await asyncio.to_thread(self._set_links, "down")

    async def heal(self) -> None:
        """Bring both ends back up (addresses and the connected route come back with them)."""
        await asyncio.to_thread(self._set_links, "up")

    async def _aclose(self) -> None:
        if self._created:
            await asyncio.to_thread(self._delete)

    def _delete(self) -> None:
        _ip("link", "del", self.root_link, check=False)  # deleting one end deletes the pair
        _ip("netns", "del", self.name, check=False)
