"""`settle_heap`: a started service's objects leave the collector's scans; its young generation is collected less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from meshllm.heap import YOUNG_THRESHOLD, settle_heap
from meshllm.lifecycle import AsyncCloseable, serve_until_signal


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """The test process's collector as it was: its thresholds, and its heap frozen again (tests/conftest.py)."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*threshold)


class _Startup:
    """A long-lived object made before the heap is settled (a service's state)."""

    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector could ever free it


def test_settle_heap_freezes_what_is_alive_and_keeps_the_older_thresholds(restored_gc: None) -> None:
    gc.unfreeze()
    middle, old = gc.get_threshold()[1:]
    startup = _Startup()
    settle_heap()
    assert gc.get_freeze_count() > 0
    assert not any(o is startup for o in gc.get_objects())  # frozen: no generation holds it, no collection scans it
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)
    later = _Startup()  # made after startup: collected as before
    assert any(o is later for o in gc.get_objects())
    del later
    assert gc.collect() >= 1


def test_settle_heap_collects_startup_garbage_before_freezing(restored_gc: None) -> None:
    gc.unfreeze()
    garbage = _Startup()
    del garbage  # unreachable, kept alive by its own cycle until a collection
    settle_heap()
    assert not any(type(o) is _Startup for o in gc.get_objects())
    gc.unfreeze()
    assert not any(type(o) is _Startup for o in gc.get_objects())  # freed, not frozen


async def test_a_service_settles_its_heap_once_it_is_up(restored_gc: None) -> None:
    gc.unfreeze()
    seen: list[int] = []

    class Service(AsyncCloseable):
        async def _aclose(self) -> None:
            pass

    async def start() -> AsyncCloseable:
        assert gc.get_freeze_count() == 0  # not before the service exists
        return Service()

    def ready(service: AsyncCloseable) -> list[str]:
        seen.append(gc.get_freeze_count())
        return []

    async def closing(service: AsyncCloseable) -> None:
        return None  # stop at once

    status = await serve_until_signal("worker", start, ready, service_name="t", otlp_endpoint=None, closing=closing)
    assert status == 0 and seen and seen[0] > 0
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
