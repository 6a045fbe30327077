"""`meshllm frontend --workers N` rules that need no process group: N is validated, `meshllm run` refuses N > 1,
the supervisor's variables make a process a group member, and the port reservation shares its port.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from meshllm.config import ConfigError
from meshllm.frontend.config import MAX_FRONTEND_WORKERS, FrontendConfig, frontend_arg_parser
from meshllm.frontend.main import group_member
from meshllm.frontend.procs import INDEX_ENV, METRICS_DIR_ENV, reserve_port, sync_note
from meshllm.ports import PortInUse
from meshllm.run import parse_run_args

STATIC = ["--static-endpoint", "ns.worker.generate", "--static-workers", "127.0.0.1:1", "--model-name", "m"]


def config(*argv: str, env: dict[str, str] | None = None) -> FrontendConfig:
    return FrontendConfig.from_namespace(frontend_arg_parser(env=env or {}).parse_args(list(argv)))


@pytest.mark.parametrize("flag", ["--workers", "--frontend-workers"])
def test_both_spellings_set_the_number_of_frontend_processes(flag: str) -> None:
    assert config(flag, "3").workers == 3
    assert config().workers == 1


def test_the_variable_is_meshllm_frontend_workers_not_the_run_commands_meshllm_workers() -> None:
    assert config(env={"MESHLLM_FRONTEND_WORKERS": "4"}).workers == 4
    assert config(env={"MESHLLM_WORKERS": "4"}).workers == 1


@pytest.mark.parametrize("n", [0, -1, MAX_FRONTEND_WORKERS + 1])
def test_an_out_of_range_number_of_processes_is_one_config_error(n: int) -> None:
    with pytest.raises(ConfigError, match="--workers must be between 1 and"):
        config("--workers", str(n))


def test_meshllm_run_refuses_more_than_one_frontend_process_and_names_the_alternative() -> None:
    assert parse_run_args(["--frontend-workers", "1"]).frontend_workers == 1
    with pytest.raises(ConfigError, match=r"meshllm frontend --workers N` with etcd \+ NATS"):
        parse_run_args(["--frontend-workers", "2"])
    with pytest.raises(ConfigError, match="--frontend-workers must be between 1"):
        parse_run_args(["--frontend-workers", "0"])


def test_the_supervisors_variables_make_a_process_a_group_member(tmp_path: Path) -> None:
    base = config()
    assert group_member(base, {}) is base
    member = group_member(base, {INDEX_ENV: "1", METRICS_DIR_ENV: str(tmp_path)})
    assert member.process_index == 1 and member.shared_metrics_dir == tmp_path
    with pytest.raises(ConfigError, match=INDEX_ENV):
        group_member(base, {INDEX_ENV: "1"})  # no shared metrics directory
    with pytest.raises(ConfigError, match=INDEX_ENV):
        group_member(base, {INDEX_ENV: "x", METRICS_DIR_ENV: str(tmp_path)})


def test_a_reserved_port_is_shared_by_reuse_port_listeners_and_refused_to_others() -> None:
    held = reserve_port("127.0.0.1", 0, flag="--http-port")
    port = held.getsockname()[1]
    with socket.socket() as member, socket.socket() as stranger:
        member.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        member.bind(("127.0.0.1", port))
        member.listen()
        with pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))  # no SO_REUSEPORT: the port is the group's
    held.close()


@pytest.mark.parametrize("foreign_reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_reserving_a_port_another_process_listens_on_is_one_line_naming_the_flag(foreign_reuse_port: bool) -> None:
    # A foreign listener with SO_REUSEPORT (any gRPC server's default) would share the port with our
    # SO_REUSEPORT reservation; the probe without SO_REUSEPORT sees it.
    with socket.socket() as taken:
        if foreign_reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse) as caught:
            reserve_port("127.0.0.1", port, flag="--grpc-port")
    assert caught.value.message == f"port {port} is already in use; choose another with --grpc-port or MESHLLM_GRPC_PORT"
    assert isinstance(caught.value, ConfigError)


def test_the_startup_note_warns_when_the_routing_cores_have_no_bus_to_sync_over() -> None:
    static = config("--workers", "2", *STATIC)
    level, text = sync_note(static) or (0, "")
    assert level == 30 and "cannot sync" in text and "--events nats" in text
    level, text = sync_note(config("--workers", "2", *STATIC, "--events", "nats")) or (0, "")
    assert level == 20 and "over NATS" in text
    assert sync_note(config("--workers", "2", "--router-address", "127.0.0.1:1")) is None
