"""The /metrics view of `meshllm frontend --workers N` (`SharedMetricsRegistry`) over real prometheus_client
multiprocess files written by two real processes.

Locks: counters and histograms are the sum over the processes; the in-flight gauge is one sample per process
(`pid` label); families of other registries in those processes (the embedded routing core's) stay out; a dead
process's gauge leaves the view (`forget_process`) while its counts stay in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from meshllm.frontend.metrics import FrontendMetrics
from meshllm.frontend.procs import METRICS_DIR_ENV
from meshllm.frontend.shared_metrics import SharedMetricsRegistry, forget_process

WRITER = """
import sys
from pathlib import Path
from meshllm.frontend.metrics import FrontendMetrics
from meshllm.frontend.shared_metrics import SharedMetricsRegistry
from meshllm.router.metrics import RouterMetrics
chats, inflight = int(sys.argv[2]), int(sys.argv[3])
m = FrontendMetrics(registry=SharedMetricsRegistry(Path(sys.argv[1])))
for _ in range(chats):
    m.requests.labels("/v1/chat/completions", "200", "mocker").inc()
    m.for_model("mocker").ttft.observe(0.003)
m.inflight.set(inflight)
RouterMetrics("r").requests.inc()
import os
print(os.getpid())
"""


def write(path: Path, chats: int, inflight: int) -> int:
    env = {**os.environ, METRICS_DIR_ENV: str(path)}
    out = subprocess.run([sys.executable, "-c", WRITER, str(path), str(chats), str(inflight)], env=env, check=True,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return int(out.stdout)


def samples(metrics: FrontendMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_processes_counts_sum_and_each_keeps_its_own_gauge(tmp_path: Path) -> None:
    pid_a, pid_b = write(tmp_path, 3, 2), write(tmp_path, 5, 7)
    view = samples(FrontendMetrics(registry=SharedMetricsRegistry(tmp_path)))
    chat = ("meshllm_frontend_requests_total", (("model", "mocker"), ("route", "/v1/chat/completions"), ("status", "200")))
    assert view[chat] == 8
    assert view[("meshllm_frontend_time_to_first_token_seconds_count", (("model", "mocker"),))] == 8
    assert view[("meshllm_frontend_inflight_requests", (("pid", str(pid_a)),))] == 2
    assert view[("meshllm_frontend_inflight_requests", (("pid", str(pid_b)),))] == 7
    assert not [name for name, _ in view if name.startswith("meshllm_router_")]

    forget_process(tmp_path, pid_b)
    view = samples(FrontendMetrics(registry=SharedMetricsRegistry(tmp_path)))
    assert view[chat] == 8
    assert [labels for name, labels in view if name == "meshllm_frontend_inflight_requests"] == [(("pid", str(pid_a)),)]
