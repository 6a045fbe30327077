"""`meshllm.lifecycle.Admission`: the admission/drain state shared by the frontend and the worker."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.lifecycle import Admission


async def test_wait_idle_returns_at_once_when_nothing_is_in_flight() -> None:
    async with asyncio.timeout(2):
        await Admission().wait_idle()


async def test_wait_idle_waits_for_the_last_exit() -> None:
    changes: list[int] = []
    adm = Admission(on_change=changes.append)
    adm.enter()
    adm.enter()
    waiter = asyncio.ensure_future(adm.wait_idle())
    adm.exit()
    await asyncio.wait({waiter}, timeout=0.05)  # one still in flight: the waiter must not return
    assert not waiter.done() and adm.inflight == 1
    adm.exit()
    async with asyncio.timeout(2):
        await waiter
    assert adm.inflight == 0
    assert changes == [1, 1, -1, -1]


async def test_admitted_exits_when_the_block_raises() -> None:
    adm = Admission()
    with pytest.raises(RuntimeError), adm.admitted():
        assert adm.inflight == 1
        raise RuntimeError("boom")
    assert adm.inflight == 0
    async with asyncio.timeout(2):
        await adm.wait_idle()


def test_admitting_is_a_plain_flag_the_caller_reads() -> None:
    adm = Admission()
    assert adm.admitting
    adm.admitting = False
    adm.enter()  # refusing is the caller's decision (its own error): enter still counts
    assert adm.inflight == 1
