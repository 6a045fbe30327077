"""/metrics of a frontend process group (`meshllm frontend --workers N`): every process's families, summed.

The processes write prometheus_client's multiprocess files into one
directory (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before they
import prometheus_client); `SharedMetricsRegistry` reads them back.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["SharedMetricsRegistry", "forget_process", "shared_metrics_dir"]


class SharedMetricsRegistry(CollectorRegistry):
    """The /metrics view of a process group: this registry's metric families, summed over every process.

    Metrics register here as usual (names are checked for clashes); the
    exposition reads the prometheus_client multiprocess files of `path`, so
    counters and histograms are the group's totals (a dead process's counts
    stay in) and gauges carry a `pid` label (each process's own value). The
    process must have been started with PROMETHEUS_MULTIPROC_DIR=`path`.
    Families of other registries in the same processes (the embedded routing
    core's) are left out, as a single frontend leaves them out.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def collect(self) -> Iterable[Any]:
        own = {family.name for family in super().collect()}
        for family in MultiProcessCollector(None, str(self.path)).collect():
            if family.name in own:
                yield family


def forget_process(path: Path, pid: int) -> None:
    """Drop a dead process's gauges from the shared view (its counters and histograms stay: totals never go back)."""
    for f in path.glob(f"gauge_*_{pid}.db"):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


def shared_metrics_dir(given: str | None) -> tuple[Path, Path | None]:
    """PROMETHEUS_MULTIPROC_DIR when set (kept afterwards), else a new temporary directory (removed at exit)."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        return path, None
    path = Path(tempfile.mkdtemp(prefix="meshllm-frontend-metrics-"))
    return path, path
