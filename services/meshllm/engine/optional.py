"""Engines whose library is optional (TensorRT-LLM, vLLM): import it lazily, and say in one line what is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from meshllm.config import ConfigError

__all__ = ["first_line", "import_engine_library"]


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type's name when it says nothing)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def import_engine_library(module: str, library: str, engine: str, hint: str) -> ModuleType:
    """`import module`, or a one-line ConfigError: the library is absent, lacks a dependency, or fails to import."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == module:
            raise ConfigError(f"the {engine} engine needs {library}: {hint}") from None
        raise ConfigError(f"{library} is installed but needs the missing module {exc.name!r}: {hint}") from None
    except Exception as exc:  # missing CUDA libraries, a torch build that does not match, a placeholder package, ...
        raise ConfigError(
            f"{library} is installed but cannot be imported ({type(exc).__name__}: {first_line(exc)}); "
            f"see docs/engines/{engine}.md"
        ) from None
