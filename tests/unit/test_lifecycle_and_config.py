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
