"""The `meshllm` command: one subcommand per process kind (ARCHITECTURE §1)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from meshllm import __version__

__all__ = ["COMMANDS", "main"]

# subcommand -> ("module:function" taking argv and returning an exit code, or
# None while not built yet; one-line description)
COMMANDS: dict[str, tuple[str | None, str]] = {
    "run": ("meshllm.run:main", "frontend + router + workers in one process (the embedded default)"),
    "frontend": ("meshllm.frontend.main:main", "OpenAI HTTP API and text gRPC Inference API"),
    "bench": ("meshllm.bench.main:main", "load generator for any OpenAI endpoint (latency percentiles, goodput, JSON, CSV)"),
    "router": ("meshllm.router.main:main", "KV-aware router: routes, disaggregates, migrates"),
    "worker": ("meshllm.worker.main:main", "one inference engine behind the Worker gRPC service"),
    "planner": ("meshllm.planner.main:main", "SLA planner: scales prefill and decode workers to TTFT and ITL targets"),
    "health": ("meshllm.health:main", "probe a meshllm gRPC server's health (exit 0 when SERVING)"),
    "certs": ("meshllm.certs:main", "create a development CA and per-service TLS certificates"),
    "completion": ("meshllm.completion:main", "print a shell completion script: meshllm completion bash|zsh"),
}

USAGE = "usage: meshllm {" + ",".join(COMMANDS) + "} [options]  (meshllm COMMAND --help for its flags)"


def _load(target: str) -> Callable[[Sequence[str]], int]:
    module, _, func = target.partition(":")
    fn: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module), func)
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        width = max(map(len, COMMANDS))
        for name, (_, desc) in COMMANDS.items():
            print(f"  {name:<{width}}  {desc}")
        return 0 if args else 2
    if args[0] == "--version":
        print(f"meshllm {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"meshllm: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    if target is None:
        print(f"meshllm {name}: not implemented yet", file=sys.stderr)
        return 2
    return _load(target)(rest)
