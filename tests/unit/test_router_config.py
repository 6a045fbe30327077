"""Router flags and MESHLLM_* variables → RouterConfig; static mode validation; one-line errors."""

from __future__ import annotations

import pytest

from meshllm.config import ConfigError, DiscoveryKind, EventsKind
from meshllm.router.config import RouterConfig, RouterMode, router_arg_parser
from meshllm.router.main import main


def build(*argv: str, env: dict[str, str] | None = None) -> RouterConfig:
    return RouterConfig.from_namespace(router_arg_parser(env=env or {}).parse_args(list(argv)))


def test_defaults_follow_the_issue() -> None:
    cfg = build()
    assert cfg.mode is RouterMode.KV and cfg.tuning.temperature == 0 and cfg.tuning.overlap_weight == 1.0
    assert cfg.tuning.ttl_s == 120 and cfg.tuning.migration_limit == 3
    assert cfg.plane.discovery is DiscoveryKind.ETCD and cfg.plane.events is EventsKind.NATS
    assert not cfg.static


def test_flags_and_environment_build_the_config() -> None:
    cfg = build("--router-mode", "round-robin", "--kv-overlap-weight", "2", env={"MESHLLM_ROUTER_TEMPERATURE": "0.5"})
    assert cfg.mode is RouterMode.ROUND_ROBIN and cfg.tuning.overlap_weight == 2 and cfg.tuning.temperature == 0.5


def test_static_mode_needs_no_planes() -> None:
    cfg = build("--static-endpoint", "dyn.backend.generate", "--static-workers", "127.0.0.1:1,127.0.0.1:2", "--model-name", "m")
    assert cfg.static and cfg.static_workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert cfg.plane.discovery is DiscoveryKind.STATIC and cfg.plane.events is EventsKind.NONE
    assert cfg.plane.namespace == "dyn"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--static-endpoint", "a.b", "--static-workers", "h:1", "--model-name", "m"], "namespace.component.endpoint"),
        (["--static-endpoint", "a.b.c", "--static-workers", "nohost", "--model-name", "m"], "host:port"),
        (["--static-endpoint", "a.b.c", "--static-workers", "h:1"], "--model-name"),
        (["--static-endpoint", "a.b.c", "--static-workers", "h:1", "--model-name", " "], "--model-name"),
        (["--router-temperature", "-1"], "--router-temperature"),
        (["--router-ttl", "0"], "--router-ttl"),
        (["--disagg-max-local-hit", "1.5"], "--disagg-max-local-hit"),
        (["--kv-pull-gbps", "-1"], "--kv-pull-gbps"),
        (["--kv-pull-gbps", "nan"], "--kv-pull-gbps"),
        (["--migration-limit", "-2"], "--migration-limit"),
    ],
)
def test_bad_values_are_refused_with_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(*argv)


def test_main_prints_one_line_and_exits_2_on_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--static-endpoint", "bad", "--static-workers", "h:1", "--model-name", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshllm router: error:") and "static-endpoint" in err[0]


def test_main_rejects_an_unknown_mode_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--router-mode", "best"])
    assert exc.value.code == 2
    assert "--router-mode" in capsys.readouterr().err
