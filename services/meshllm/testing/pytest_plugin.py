"""pytest plugin of meshllm (registered by entry point): real-server fixtures.

Fixtures: `etcd_server` and `nats_server` (one fresh real server per test).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from meshllm.testing.servers import EtcdServer, NatsServer


@pytest_asyncio.fixture
async def etcd_server() -> AsyncIterator[EtcdServer]:
    """A real etcd on a free loopback port, removed after the test."""
    async with EtcdServer() as server:
        yield server


@pytest_asyncio.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    """A real nats-server on a free loopback port, removed after the test."""
    async with NatsServer() as server:
        yield server
