"""bench/harness: what every scenario starts servers with, samples CPU with and reads readiness from.

Locks: `server_process` yields only once the server lists a model, stops it (the process is gone after), and fails
at once, with the server's stderr, when the server exits before it serves; `ready_match` skips an engine's own
stdout lines; `rotated` gives every system every position; `process_seconds` reads a process's own threads only.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from bench_support import BENCH, load_bench

from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import free_port

MODELS_SERVER = textwrap.dedent(
    """
    import http.server, json, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m1"}, {"id": "m2"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_server_process_yields_once_the_server_lists_its_models_and_stops_it_after() -> None:
    servers = load_bench("harness.servers")
    port = free_port()
    async with servers.server_process([sys.executable, "-c", MODELS_SERVER, str(port)], port=port) as served:
        assert served.url == f"http://127.0.0.1:{port}"
        assert served.models == ("m1", "m2")
        assert not _gone(served.pid)
        pid = served.pid
    assert _gone(pid)


async def test_server_process_fails_at_once_with_the_servers_stderr_when_it_exits_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    servers = load_bench("harness.servers")
    port = free_port()
    argv = [sys.executable, "-c", "import sys; sys.exit('no such model: x.gguf')"]
    with pytest.raises(RuntimeError, match="stopped before it served"):
        async with asyncio.timeout(30):  # far below ready_s: the exit is noticed, not waited out
            async with servers.server_process(argv, port=port, ready_s=600):
                pytest.fail("yielded without a server")
    assert "no such model: x.gguf" in capsys.readouterr().out


async def test_ready_match_skips_lines_until_the_pattern() -> None:
    servers = load_bench("harness.servers")
    script = "print('engine log line'); print('meshllm worker: serving on 127.0.0.1:4242'); input()"
    proc = MeshllmProcess(prefix=[sys.executable, "-c", script, "--"])
    try:
        assert await servers.serving_address(proc, 30) == "127.0.0.1:4242"
    finally:
        await proc.stop()


def test_rotated_puts_every_system_first_equally_often() -> None:
    servers = load_bench("harness.servers")
    orders = [servers.rotated(["a", "b", "c"], k) for k in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    assert servers.rotated(["a", "b"], 5) == ["b", "a"]


def test_process_seconds_reads_a_process_s_own_threads(tmp_path: Path) -> None:
    cpu = load_bench("harness.cpu")
    (tmp_path / "7").mkdir()
    # proc(5): pid (comm) state ppid ... utime(14) stime(15) cutime(16) cstime(17)
    (tmp_path / "7" / "stat").write_text("7 (py (x)) S 1 1 1 0 -1 0 0 0 0 0 300 100 50 50 20 0 3 0 100 0 0\n")
    assert cpu.process_seconds(7, tmp_path) == pytest.approx(400 / cpu.TICK)


def test_the_harness_finds_the_repository_it_lives_in() -> None:
    """Locks: moved one folder down, the harness still writes docs/benchmarks.md and finds ../shared's Dynamo."""
    root = Path(__file__).resolve().parents[2]
    assert load_bench("harness.doc").DOC == root / "docs" / "benchmarks.md"
    systems = load_bench("harness.systems")
    assert systems.ROOT == root
    assert systems.DYNAMO_DIR == root.parent / "shared" / "anchors" / "dynamo"


async def test_take_turns_gives_every_system_every_block_rotating_who_goes_first(tmp_path: Path) -> None:
    cpu = load_bench("harness.cpu")
    turns_mod = load_bench("harness.turns")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (py) S 1 1 1 0 -1 0 0 0 0 0 300 100 0 0 20 0 3 0 100 0 0\n")
    meters = {name: cpu.CpuMeter({"server": 7}, proc=tmp_path) for name in ("a", "b", "c")}
    sent: list[tuple[str, tuple[int, ...]]] = []

    async def send(name: str, block: Sequence[int]) -> None:
        sent.append((name, tuple(block)))

    turns = await turns_mod.take_turns(meters, [1, 2, 3, 4, 5], 2, send)
    assert [n for n, _ in sent] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {n: [b for m, b in sent if m == n] for n in "abc"} == {n: [(1, 2), (3, 4), (5,)] for n in "abc"}
    assert all(len(turns.seconds[n]) == 3 and min(turns.seconds[n]) >= 0 for n in "abc")
    assert turns.cpu_s == {n: {"server": 0.0} for n in "abc"}  # its /proc did not move


def test_every_report_s_percentiles_interpolate_as_meshllm_bench_s() -> None:
    """Locks: one percentile for every scenario (the scripts had three: nearest rank two ways, and interpolated)."""
    stats = load_bench("harness.stats")
    values = [float(v) for v in range(1, 11)]
    assert stats.pct(values, 50) == 5.5 and stats.pct(values, 90) == pytest.approx(9.1)
    assert stats.triple(values) == "5.5 / 9.1 / 9.9" and stats.triple(values, "{:.2f}") == "5.50 / 9.10 / 9.91"
    assert stats.pct([], 99) != stats.pct([], 99)  # NaN: no values, no figure
    scripts = sorted(p.name for p in BENCH.glob("*.py") if re.search(r"^def (pct|percentile)\(", p.read_text(), re.M))
    assert not scripts, f"scripts with their own percentile: {scripts}"
