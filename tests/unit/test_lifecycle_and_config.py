"""meshllm.lifecycle and meshllm.config: ordered idempotent shutdown, env-backed flags."""

import asyncio

import pytest

from meshllm.config import ConfigError, DiscoveryKind, EnvArgumentParser, PlaneConfig, add_plane_args
from meshllm.lifecycle import AsyncCloseable, Shutdown


async def test_shutdown_runs_steps_in_order_once_even_when_called_concurrently() -> None:
    """Locks: concurrent run() calls execute each step exactly once, in order, despite failures."""
    order: list[str] = []

    async def step(name: str, fail: bool = False) -> None:
        order.append(name)
        if fail:
            raise RuntimeError(name)

    sd = Shutdown()
    sd.add("unregister", lambda: step("unregister"))
    sd.add("drain", lambda: step("drain", fail=True))
    sd.add("hang", lambda: asyncio.Event().wait(), timeout_s=0.05)
    sd.add("cleanup", lambda: step("cleanup"))
    await asyncio.gather(sd.run(), sd.run(), sd.run())
    assert order == ["unregister", "drain", "cleanup"]
    assert sd.completed == ["unregister", "drain", "hang", "cleanup"]
    with pytest.raises(RuntimeError):
        sd.add("late", lambda: step("late"))


async def test_async_closeable_closes_once() -> None:
    class Thing(AsyncCloseable):
        closes = 0

        async def _aclose(self) -> None:
            Thing.closes += 1
            await asyncio.sleep(0)

    async with Thing() as t:
        pass
    await asyncio.gather(t.aclose(), t.aclose())
    assert Thing.closes == 1 and t.closed


class _Service(AsyncCloseable):
    def __init__(self) -> None:
        self.closes = 0

    async def _aclose(self) -> None:
        self.closes += 1


async def test_started_returns_the_object_or_closes_it_and_reraises() -> None:
    """Locks the start-up rule of every service: a failed start closes what it opened, once, and re-raises."""

    async def ok() -> None:
        return None

    async def broken() -> None:
        raise RuntimeError("port taken")

    good = _Service()
    assert await good.started(ok()) is good and good.closes == 0 and not good.closed
    bad = _Service()
    with pytest.raises(RuntimeError, match="port taken"):
        await bad.started(broken())
    assert bad.closes == 1 and bad.closed


def test_flags_default_to_their_meshllm_environment_variables() -> None:
    """Locks: --etcd-endpoints reads MESHLLM_ETCD_ENDPOINTS; a flag overrides it."""
    env = {"MESHLLM_ETCD_ENDPOINTS": "10.0.0.1:2379,10.0.0.2:2379", "MESHLLM_NAMESPACE": "prod"}
    parser = EnvArgumentParser(prog="meshllm x", env=env)
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    cfg = PlaneConfig.from_namespace(parser.parse_args([]))
    assert cfg.etcd_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379") and cfg.namespace == "prod"
    cfg = PlaneConfig.from_namespace(parser.parse_args(["--namespace", "dev"]))
    assert cfg.namespace == "dev"


def test_bad_plane_values_fail_with_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="not host:port"):
        PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=("nohost",))
    with pytest.raises(ConfigError, match="namespace"):
        PlaneConfig(namespace="a b")


def test_parser_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = EnvArgumentParser(prog="meshllm worker")
    parser.add_argument("--port", type=int, default=0)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--port", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshllm worker: error:")


async def test_serve_until_signal_reports_start_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Locks: a ConfigError at start → exit 2, another MeshError → exit 1, one stderr line each."""
    from meshllm.errors import Unavailable
    from meshllm.lifecycle import serve_until_signal

    async def bad_config() -> AsyncCloseable:
        raise ConfigError("--port 70000 is out of range")

    async def unavailable() -> AsyncCloseable:
        raise Unavailable("cannot reach etcd")

    assert await serve_until_signal("x", bad_config, lambda s: [], service_name="t", otlp_endpoint=None) == 2
    assert await serve_until_signal("x", unavailable, lambda s: [], service_name="t", otlp_endpoint=None) == 1
    assert capsys.readouterr().err.splitlines() == [
        "meshllm x: error: --port 70000 is out of range",
        "meshllm x: error: cannot reach etcd",
    ]


async def test_serve_until_signal_prints_ready_lines_and_closes_when_the_closing_hook_returns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locks: ready lines on stdout; the closing hook (e.g. a Drain RPC) ends the command with the service closed."""
    from meshllm.lifecycle import serve_until_signal

    monkeypatch.setattr("meshllm.lifecycle.settle_heap", lambda: None)  # test_heap.py's; the test process's heap stays

    class Service(AsyncCloseable):
        drained = asyncio.Event()
        closed_by_serve = False

        async def _aclose(self) -> None:
            Service.closed_by_serve = True

    async def start() -> Service:
        asyncio.get_running_loop().call_soon(Service.drained.set)
        return Service()

    async def closing(s: Service) -> None:
        await Service.drained.wait()

    rc = await serve_until_signal("x", start, lambda s: ["ready at here"], service_name="t", otlp_endpoint=None, closing=closing)
    assert rc == 0 and Service.closed_by_serve
    assert capsys.readouterr().out == "ready at here\n"


def test_command_error_prints_the_one_line_and_returns_its_status(capsys: pytest.CaptureFixture[str]) -> None:
    """Locks: every command's failure line, `meshllm COMMAND: error: MESSAGE` on stderr; exit 2 unless told."""
    from meshllm.lifecycle import command_error

    assert command_error("planner profile", "cannot write out.json: denied", 1) == 1
    assert command_error("router", "--port 70000 is out of range") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "meshllm planner profile: error: cannot write out.json: denied",
        "meshllm router: error: --port 70000 is out of range",
    ]


def test_run_command_serves_the_config_or_exits_2_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    """Locks: a ConfigError from `configure` is one line and exit 2, and nothing is served; else `serve`'s status."""
    from meshllm.lifecycle import run_command

    served: list[str] = []

    async def serve(config: str) -> int:
        served.append(config)
        return 7

    def bad() -> str:
        raise ConfigError("--interval must be > 0")

    assert run_command("planner", bad, serve) == 2
    assert served == []
    assert capsys.readouterr().err == "meshllm planner: error: --interval must be > 0\n"
    assert run_command("planner", lambda: "config", serve) == 7
    assert served == ["config"]
