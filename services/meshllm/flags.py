"""The one description of a service's flags: the parser, the config object built from it, the docs' tables.

A service describes each flag once, with `add_argument` on an `EnvArgumentParser`: its name, type, default and the
meaning that `--help` prints and docs/operations.md's flag tables show (`meshllm.flag_docs` writes them). The
`MESHLLM_*` variable of a flag (`--etcd-endpoints` reads `MESHLLM_ETCD_ENDPOINTS`) is its default. The service's
frozen config dataclass is then built from the parsed flags by `from_flags`: a field takes the flag of its own
name, so no value is copied by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TypeVar

__all__ = [
    "DefaultsHelpFormatter",
    "EnvArgumentParser",
    "doc_default",
    "env_name",
    "flag_value",
    "from_flags",
    "parse_byte_size",
    "split_engine_args",
    "terminal_help",
]

T = TypeVar("T")


def from_flags(cls: type[T], ns: Any, /, *, prefix: str = "", **computed: Any) -> T:
    """`cls` (a dataclass) from parsed flags. Each init field takes, in this order:

    - `computed[field]`: values a flag does not hold as is (parsed, combined, defaulted or nested configs);
    - the flag `cls.FLAG_DESTS[field]` names (a `ClassVar` mapping, for fields named apart from their flag);
    - the flag of the field's own name after `prefix` (`--etcd-ca` for `ca`), or for a field `X_s` (seconds)
      the flag `X`.

    A field whose flag the parser lacks (another command's parser) keeps its dataclass default. A name in
    `computed` or `FLAG_DESTS` that is not a field is a programming error (TypeError). That every flag is read by
    some config is tests/unit/test_flags_read.py's check.
    """
    renames: Mapping[str, str] = getattr(cls, "FLAG_DESTS", {})
    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    if unknown := (set(computed) | set(renames)) - names:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    values = dict(computed)
    for name in names - set(computed):
        dests = (renames[name],) if name in renames else (prefix + name, prefix + name.removesuffix("_s"))
        dest = next((d for d in dests if hasattr(ns, d)), None)
        if dest is not None:
            values[name] = getattr(ns, dest)
    return cls(**values)


def split_engine_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """A command's own flags and, after the first `--`, the flags it hands to the engine."""
    args = list(argv)
    if "--" not in args:
        return args, []
    cut = args.index("--")
    return args[:cut], args[cut + 1 :]


def env_name(flag: str) -> str:
    """`--etcd-endpoints` -> `MESHLLM_ETCD_ENDPOINTS`."""
    return "MESHLLM_" + flag.lstrip("-").replace("-", "_").upper()


_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


def terminal_help(text: str) -> str:
    """A flag's help as `--help` prints it: its Markdown (code spans, links) as plain text."""
    return _LINK.sub(r"\1", text).replace("`", "")


def doc_default(action: argparse.Action, text: str) -> argparse.Action:
    """Say in the docs' flag tables what `action`'s default is, where its value alone does not (meshllm.flag_docs)."""
    action.doc_default = text  # type: ignore[attr-defined]
    return action


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows each option's default, "(default: 8000)", unless it has none or its help already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or text == argparse.SUPPRESS or "default" in text.lower():
            return action.help
        if default is None or default is False or default is argparse.SUPPRESS or default in ("", [], ()):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def flag_value(value: object) -> bool:
    """A BooleanOptionalAction flag's value: a bool from the command line, or a MESHLLM_* variable's string."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options default to their `MESHLLM_*` variable.

    `--help` shows every option's default (`DefaultsHelpFormatter`) and its
    variable. Help texts are the meanings in the docs' flag tables (Markdown,
    which `--help` prints plain; `meshllm.flag_docs` writes the tables).
    Errors print one line (`meshllm worker: error: ...`) and exit with status 2.
    """

    def __init__(self, *args: Any, env: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.env: Mapping[str, str] = env if env is not None else {}

    def _apply_env(self) -> None:
        # Runs at parse time so arguments added through groups are covered too.
        if getattr(self, "_env_applied", False):
            return
        self._env_applied = True
        for action in self._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            var = env_name(longs[0])
            if action.help is not None and action.help != argparse.SUPPRESS:
                action.markdown_help = action.help  # type: ignore[attr-defined]  # the docs' text (meshllm.flag_docs)
                action.help = f"{terminal_help(action.help)} [env {var}]"
            if var not in self.env:
                continue
            raw = self.env[var]
            if isinstance(action, argparse._StoreTrueAction):
                action.default = raw.strip().lower() in ("1", "true", "yes", "on")
                continue
            try:
                value: Any = action.type(raw) if callable(action.type) else raw
            except (TypeError, ValueError) as exc:
                self.error(f"{var}={raw!r}: {exc}")
            if action.choices is not None and value not in action.choices:
                self.error(f"{var}={raw!r}: choose from {', '.join(map(str, action.choices))}")
            action.default = value
            action.required = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._apply_env()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._apply_env()
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_BYTE_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]i?)?b?", re.IGNORECASE)


class _ByteSizeError(argparse.ArgumentTypeError, ValueError):
    """A bad byte count: argparse shows the message as is (and `ValueError` for env values and callers)."""


def parse_byte_size(text: str) -> int:
    """A byte count of a budget flag: `1073741824`, `64GiB`, `1.5G`, `512MB`.

    K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024 (as in SI and IEC);
    a trailing B is optional and case does not matter. Every size flag of every
    engine parses with this one, so `2G` means the same everywhere.
    """
    m = _BYTE_SIZE.fullmatch(text.strip())
    if m is None:
        raise _ByteSizeError(f"expected a byte count such as 68719476736, 64GiB or 500MB, got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[(m.group(2) or "").lower()])
