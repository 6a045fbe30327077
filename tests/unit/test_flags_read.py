"""Every flag of every command is read by the config its command builds: no dead flag.

A flag is described once, on its parser (meshllm.flags), and its service's config is built from the parsed flags
(`from_flags` and each config's `from_namespace`). A flag no config reads is parsed, documented and ignored: the
`--worker-component` of an earlier release. Each command's flags are parsed at their defaults into a namespace
that logs what is read, the command's configs are built from it, and every flag must have been read.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest

from meshllm.engine.llamacpp.config import LlamaCppConfig, add_llamacpp_args
from meshllm.engine.mocker.config import MockerConfig, add_mocker_args
from meshllm.engine.trtllm.config import TrtllmConfig, add_trtllm_args
from meshllm.engine.vllm.config import VllmConfig, add_vllm_args
from meshllm.engine.worker_config import WorkerConfig, worker_arg_parser
from meshllm.flags import EnvArgumentParser, from_flags
from meshllm.frontend.config import FrontendConfig, frontend_arg_parser
from meshllm.planner.config import PlannerConfig, planner_arg_parser
from meshllm.planner.profiler import profile_arg_parser, profile_plan
from meshllm.router.config import RouterConfig, router_arg_parser
from meshllm.run import run_arg_parser, run_config


class ReadLog(argparse.Namespace):
    """A namespace that, once `watch()`ed, records every attribute read."""

    def watch(self) -> set[str]:
        read: set[str] = set()
        object.__setattr__(self, "_read", read)
        return read

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            read = object.__getattribute__(self, "__dict__").get("_read")
            if read is not None:
                read.add(name)
        return object.__getattribute__(self, name)


def _engine(add: Callable[[EnvArgumentParser], None], name: str) -> Callable[[], EnvArgumentParser]:
    def parser() -> EnvArgumentParser:
        p = worker_arg_parser(name, env={})
        add(p)
        return p

    return parser


COMMANDS: dict[str, tuple[Callable[[], argparse.ArgumentParser], Sequence[str], Callable[[Any], object]]] = {
    "frontend": (lambda: frontend_arg_parser(env={}), [], FrontendConfig.from_namespace),
    "router": (lambda: router_arg_parser(env={}), [], RouterConfig.from_namespace),
    "planner": (lambda: planner_arg_parser(env={}), [], PlannerConfig.from_namespace),
    "planner profile": (lambda: profile_arg_parser(env={}), [], profile_plan),
    "run": (lambda: run_arg_parser(env={}), [], run_config),
    "worker --engine mocker": (
        _engine(add_mocker_args, "mocker"),
        [],
        lambda ns: (WorkerConfig.from_namespace(ns, engine="mocker"), MockerConfig.from_namespace(ns)),
    ),
    "worker --engine llamacpp": (
        _engine(add_llamacpp_args, "llamacpp"),
        [],
        lambda ns: (WorkerConfig.from_namespace(ns, engine="llamacpp"), LlamaCppConfig.from_namespace(ns)),
    ),
    "worker --engine vllm": (
        _engine(add_vllm_args, "vllm"),
        [],
        lambda ns: (WorkerConfig.from_namespace(ns, engine="vllm"), VllmConfig.from_namespace(ns, cpu=True)),
    ),
    "worker --engine trtllm": (
        _engine(add_trtllm_args, "trtllm"),
        ["--model-path", "org/model"],
        lambda ns: (WorkerConfig.from_namespace(ns, engine="trtllm"), TrtllmConfig.from_namespace(ns)),
    ),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_the_command_is_read_by_its_config(command: str) -> None:
    make, argv, build = COMMANDS[command]
    parser = make()
    ns = parser.parse_args(list(argv), namespace=ReadLog())
    read = ns.watch()
    build(ns)
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    unread = sorted(dests - read)
    assert not unread, f"`meshllm {command}` parses flags no config reads: {unread}"


def test_the_check_finds_a_flag_nothing_reads() -> None:
    parser = frontend_arg_parser(env={})
    parser.add_argument("--worker-component", default="backend")
    ns = parser.parse_args([], namespace=ReadLog())
    read = ns.watch()
    FrontendConfig.from_namespace(ns)
    assert "worker_component" not in read and "http_port" in read


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Example:
    FLAG_DESTS: ClassVar[dict[str, str]] = {"temperature": "router_temperature"}

    temperature: float = 0.0
    timeout_s: float = 1.0
    port: int = 0
    name: str = "x"
    untouched: int = 7


def test_from_flags_takes_each_field_from_its_flag() -> None:
    ns = argparse.Namespace(router_temperature=0.5, timeout=3.0, port=80, name="from flag", unrelated=1)
    assert from_flags(_Example, ns, name="computed") == _Example(temperature=0.5, timeout_s=3.0, port=80, name="computed")
    tls = argparse.Namespace(etcd_port=2379, port=80)
    assert from_flags(_Example, tls, prefix="etcd_").port == 2379
    assert from_flags(_Example, argparse.Namespace()) == _Example()  # another command's parser: defaults


def test_from_flags_refuses_a_name_that_is_no_field() -> None:
    with pytest.raises(TypeError, match="no field tempreature"):
        from_flags(_Example, argparse.Namespace(), tempreature=1.0)
