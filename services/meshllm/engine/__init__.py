"""Engines behind the `LLMEngine` contract (`meshllm.engine.base`) and their registry."""

from __future__ import annotations

import importlib

from meshllm.config import ConfigError
from meshllm.engine.base import LLMEngine

__all__ = ["BUILTIN_ENGINES", "load_engine_class"]

# --engine NAME -> "module:Class"; anything else is taken as "module:Class" itself.
BUILTIN_ENGINES: dict[str, str] = {
    "sample": "meshllm.engine.sample:SampleEngine",
    "mocker": "meshllm.engine.mocker.engine:MockerEngine",
    "llamacpp": "meshllm.engine.llamacpp.engine:LlamaCppEngine",
    "trtllm": "meshllm.engine.trtllm.engine:TrtllmEngine",
    "vllm": "meshllm.engine.vllm.engine:VllmEngine",
}


def load_engine_class(name: str) -> type[LLMEngine]:
    """Resolve `--engine NAME|package.module:Class` to an LLMEngine subclass."""
    target = BUILTIN_ENGINES.get(name, name)
    module_name, sep, cls_name = target.partition(":")
    if not sep or not module_name or not cls_name:
        raise ConfigError(f"--engine {name!r} is neither a built-in ({', '.join(BUILTIN_ENGINES)}) nor module:Class")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"--engine {name!r}: cannot import {exc.name!r} ({exc})") from None
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, LLMEngine)):
        raise ConfigError(f"--engine {name!r}: {target} is not an LLMEngine subclass")
    return cls
