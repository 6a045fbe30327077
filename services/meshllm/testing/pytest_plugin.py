"""pytest plugin of meshllm (registered by entry point): real-server fixtures and the engine conformance kit.

Fixtures: `etcd_server` and `nats_server` (one fresh real server per test).

Conformance: `pytest --meshllm-engine mypkg.engine:MyEngine [--meshllm-engine-args "--flag x"]`
adds one test per contract clause (`meshllm-conformance::<clause>`) that runs
`meshllm.testing.conformance` against fresh engines built by `MyEngine.from_args`.
`--meshllm-conformance-option NAME=VALUE` overrides a `ConformanceOptions` field
(e.g. `start_timeout_s=900`, `compare_concurrent_outputs=false`).
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from meshllm.testing.conformance import (
    CHECKS,
    Clause,
    ConformanceError,
    ConformanceOptions,
    EngineFactory,
    factory_for,
    options_from_strings,
    run_check,
)
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


# ------------------------------------------------------------------ conformance


@dataclass(frozen=True, slots=True)
class _Target:
    name: str
    factory: EngineFactory
    options: ConformanceOptions


_TARGET = pytest.StashKey[_Target]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshllm", "meshllm engine conformance kit")
    group.addoption(
        "--meshllm-engine",
        metavar="MODULE:CLASS",
        default=None,
        help="run the engine conformance kit against this engine (a built-in name or package.module:Class)",
    )
    group.addoption(
        "--meshllm-engine-args",
        metavar="ARGS",
        default="",
        help='engine flags passed to from_args, shell-quoted in one string (e.g. "--model-path m.gguf")',
    )
    group.addoption(
        "--meshllm-conformance-option",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="override a meshllm.testing.conformance.ConformanceOptions field (repeatable)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--meshllm-engine", default=None)
    if not name:
        return
    from meshllm.config import ConfigError
    from meshllm.engine import load_engine_class

    try:
        cls = load_engine_class(name)
        options = options_from_strings(config.getoption("--meshllm-conformance-option"))
    except (ConfigError, ValueError) as exc:
        raise pytest.UsageError(f"--meshllm-engine: {exc}") from None
    argv = shlex.split(config.getoption("--meshllm-engine-args"))
    config.stash[_TARGET] = _Target(name, factory_for(cls, argv), options)


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection sees the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    target = config.stash.get(_TARGET, None)
    if target is None:
        return
    suite = ConformanceSuite.from_parent(session, name="meshllm-conformance", nodeid="meshllm-conformance", target=target)
    found = suite.collect()
    # Report them like collected items, so "collected N items" and -k / -m treat them alike.
    session.ihook.pytest_collectreport(report=pytest.CollectReport(suite.nodeid, "passed", None, found))
    items.extend(item for item in found if isinstance(item, pytest.Item))


class ConformanceSuite(pytest.Collector):
    """The parent node of the conformance items (added by the plugin, not found in files)."""

    def __init__(self, *, target: _Target, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return [ConformanceItem.from_parent(self, name=clause.value, clause=clause, target=self.target) for clause in CHECKS]


class ConformanceItem(pytest.Item):
    """One contract clause checked against the engine named by --meshllm-engine."""

    def __init__(self, *, clause: Clause, target: _Target, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clause = clause
        self.target = target

    def runtest(self) -> None:
        result = asyncio.run(run_check(self.clause, self.target.factory, self.target.options))
        for note in result.notes:
            self.add_report_section("call", "conformance note", note)
        if result.skipped:
            pytest.skip(f"{self.clause}: {result.skipped}")
        if result.error is not None:
            raise result.error

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ConformanceError):
            return f"{self.target.name}: {excinfo.value}"
        return str(super().repr_failure(excinfo, style))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"meshllm conformance [{self.target.name}] {self.clause}: {self.clause.text}"
