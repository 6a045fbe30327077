"""Plane backends by kind (meshllm.plane.backends): importing it registers etcd and NATS; a kind nobody registered
is a one-line error that names the module to import, raised before anything connects."""

from __future__ import annotations

import pytest

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.errors import InvalidArgument
from meshllm.plane.discovery import base as discovery
from meshllm.plane.events import base as events


def test_importing_the_backends_module_registers_etcd_and_nats() -> None:
    import meshllm.plane.backends  # noqa: F401

    assert DiscoveryKind.ETCD in discovery._OPENERS and EventsKind.NATS in events._OPENERS


async def test_an_unregistered_kind_names_the_module_that_registers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_OPENERS", {k: v for k, v in discovery._OPENERS.items() if k is not DiscoveryKind.ETCD})
    monkeypatch.setattr(events, "_OPENERS", {k: v for k, v in events._OPENERS.items() if k is not EventsKind.NATS})
    plane = PlaneConfig(discovery=DiscoveryKind.ETCD, events=EventsKind.NATS)
    with pytest.raises(InvalidArgument, match=r"'etcd' \(import meshllm\.plane\.backends\)"):
        await discovery.open_discovery(plane)
    with pytest.raises(InvalidArgument, match=r"'nats' \(import meshllm\.plane\.backends\)"):
        await events.open_events(plane, name="t")
