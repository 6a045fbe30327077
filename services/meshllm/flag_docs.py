"""The docs' flag tables, made from the commands' own parsers.

    python -m meshllm.flag_docs            # rewrite the tables in docs/
    python -m meshllm.flag_docs --check    # exit 1 if a table is not what the parsers say

Each command's parser is the one description of its flags: the flag, its
`MESHLLM_*` variable (`env_name`), its default and its help, which is the
table's meaning (Markdown; `--help` prints it plain). A table sits between
`<!-- flags: NAME -->` and `<!-- /flags -->` in a doc and is written whole,
one row per flag (a few pairs share one: a certificate and its key, a secret
and its file), in the order the parser adds them. A default its value cannot
say ("random", "the engine's") is given with `meshllm.config.doc_default`.
tests/unit/test_flag_docs.py fails when a table is stale.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshllm.config import DiscoveryKind, EnvArgumentParser, add_plane_args, env_name
from meshllm.engine import load_engine_class
from meshllm.engine.worker_config import worker_arg_parser
from meshllm.frontend.config import frontend_arg_parser
from meshllm.planner.config import planner_arg_parser
from meshllm.planner.profiler import profile_arg_parser
from meshllm.router.config import router_arg_parser
from meshllm.run import run_arg_parser

__all__ = ["TABLES", "Collapsed", "Table", "engine_parser", "plane_parser", "render", "rewrite", "table"]

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| flag | variable | default | meaning |\n|---|---|---|---|"
#: A flag whose row is another's: (its flag, the flag of the row it joins).
JOINED = {
    "--tls-key": "--tls-cert",
    "--mesh-token-file": "--mesh-token",
    "--etcd-key": "--etcd-cert",
    "--nats-key": "--nats-cert",
}
MARKER = re.compile(r"(<!-- flags: ([\w-]+) -->\n)(.*?)(<!-- /flags -->)", re.DOTALL)


@dataclass(frozen=True)
class Collapsed:
    """An argument group shown as one row (its flags are another command's, documented there)."""

    group: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Table:
    """One doc table: a parser's flags, some of its argument groups, or those another parser lacks."""

    doc: str  # path under the repository root
    parser: Callable[[], Awaitable[argparse.ArgumentParser]]
    groups: tuple[str, ...] = ()  # only these groups (all when empty)
    skip_groups: tuple[str, ...] = ()
    without: Callable[[], argparse.ArgumentParser] | None = None  # leave out the flags this parser has too
    collapsed: tuple[Collapsed, ...] = ()


def _default(action: argparse.Action) -> str:
    said = getattr(action, "doc_default", None)
    if said is not None:
        return str(said)
    value = action.default
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return "on" if value else "off"
    if value is None or value == "":
        return "—"
    return f"`{value}`"


def _meaning(action: argparse.Action) -> str:
    text = getattr(action, "markdown_help", None) or action.help or ""
    return text.replace("%%", "%").replace("|", "\\|")


def _longs(action: argparse.Action) -> list[str]:
    return [o for o in action.option_strings if o.startswith("--") and o != "--help"]


def _actions(spec: Table, parser: argparse.ArgumentParser) -> Iterator[argparse.Action | Collapsed]:
    """The table's actions in the parser's order; a collapsed group once, where its first flag stands."""
    group_of = {id(a): g.title or "" for g in parser._action_groups for a in g._group_actions}
    skip = {o for a in spec.without()._actions for o in a.option_strings} if spec.without is not None else set()
    collapsed = {c.group: c for c in spec.collapsed}
    shown: set[str] = set()
    for action in parser._actions:
        longs, group = _longs(action), group_of.get(id(action), "")
        if not longs or set(longs) & skip or group in spec.skip_groups or (spec.groups and group not in spec.groups):
            continue
        if group in collapsed:
            if group not in shown:
                shown.add(group)
                yield collapsed[group]
            continue
        yield action


def _group_flags(parser: argparse.ArgumentParser, title: str) -> list[argparse.Action]:
    return [a for g in parser._action_groups if g.title == title for a in g._group_actions if _longs(a)]


def table(spec: Table, parser: argparse.ArgumentParser) -> str:
    """The Markdown table of `spec`, read from `parser`."""
    rows: list[list[str]] = []
    at: dict[str, list[str]] = {}
    for item in _actions(spec, parser):
        if isinstance(item, Collapsed):
            actions = _group_flags(parser, item.group)
            flags = ", ".join(f"`{o}`" for a in actions for o in _longs(a))
            names = ", ".join(f"`{env_name(_longs(a)[0])}`" for a in actions)
            rows.append([flags, names, item.default, item.meaning])
            continue
        longs = _longs(item)
        joins = JOINED.get(longs[0])
        if joins is not None and joins in at:
            row = at[joins]
            row[0] += ", " + ", ".join(f"`{o}`" for o in longs)
            row[1] += f", `{env_name(longs[0])}`"
            continue
        row = [", ".join(f"`{o}`" for o in longs), f"`{env_name(longs[0])}`", _default(item), _meaning(item)]
        at[longs[0]] = row
        rows.append(row)
    return "\n".join([HEADER, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"


def render(text: str, tables: dict[str, str]) -> str:
    """`text` with each marked table replaced by `tables[name]` (a marker without a table is an error)."""

    def one(m: re.Match[str]) -> str:
        name = m[2]
        if name not in tables:
            raise KeyError(f"no flag table named {name!r}")
        return m[1] + tables[name] + m[4]

    return MARKER.sub(one, text)


# ---------------------------------------------------------------- the tables


def plane_parser() -> argparse.ArgumentParser:
    """The discovery and event flags every service shares, alone."""
    parser = EnvArgumentParser(env={})
    add_plane_args(parser, default_discovery=DiscoveryKind.ETCD)
    return parser


async def engine_parser(name: str) -> argparse.ArgumentParser:
    """The parser an engine's `from_args` builds (taken at its `parse_args`, before it parses anything)."""
    captured: list[argparse.ArgumentParser] = []

    class Captured(Exception):
        pass

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        captured.append(self)
        raise Captured

    original = EnvArgumentParser.parse_args
    EnvArgumentParser.parse_args = capture  # type: ignore[assignment,method-assign]
    try:
        await load_engine_class(name).from_args([])
    except Captured:
        pass
    finally:
        EnvArgumentParser.parse_args = original  # type: ignore[method-assign]
    if not captured:
        raise RuntimeError(f"engine {name!r} built no EnvArgumentParser in from_args")
    return captured[0]


def _now(make: Callable[[], argparse.ArgumentParser]) -> Callable[[], Awaitable[argparse.ArgumentParser]]:
    async def parser() -> argparse.ArgumentParser:
        return make()

    return parser


def _worker_flags(engine: str) -> Callable[[], argparse.ArgumentParser]:
    """The worker's own flags, which an engine's table leaves out."""
    return lambda: worker_arg_parser(engine, env={})


PLANES = ("planes",)
CREDENTIALS = ("etcd TLS and authentication", "NATS TLS and authentication")
AS_ROUTER = "as on `meshllm router`"
AS_FRONTEND = "as for `meshllm frontend`"
TABLES: dict[str, Table] = {
    "planes": Table("docs/operations.md", _now(plane_parser), groups=PLANES),
    "plane-credentials": Table("docs/operations.md", _now(plane_parser), groups=CREDENTIALS),
    "run": Table(
        "docs/operations.md",
        _now(lambda: run_arg_parser(env={})),
        collapsed=(
            Collapsed(
                "routing",
                AS_ROUTER,
                "the embedded routing core's tuning, the same flags as [`meshllm router`](#meshllm-router)'s",
            ),
            Collapsed(
                "OpenAI output parsing and strictness",
                "`auto`, `auto`, off",
                f"tool-call and reasoning parsers and field strictness of the HTTP API, {AS_FRONTEND} "
                "([frontend.md](frontend.md#tool-calls))",
            ),
            Collapsed(
                "API keys (docs/security.md)",
                "—",
                f"API keys of the HTTP and Inference gRPC APIs, {AS_FRONTEND} ([security.md](security.md#frontend-api-keys))",
            ),
            Collapsed(
                "security",
                "—",
                "TLS (mTLS with a CA) on the HTTP API (HTTPS), the Inference and Router gRPC servers and the "
                f"workers, and the mesh token of the Router and Worker services, {AS_FRONTEND} "
                "([security.md](security.md#tls-and-mtls))",
            ),
        ),
    ),
    "frontend": Table(
        "docs/operations.md",
        _now(lambda: frontend_arg_parser(env={})),
        skip_groups=(*PLANES, *CREDENTIALS),
        collapsed=(
            Collapsed(
                "routing",
                AS_ROUTER,
                "the embedded routing core's tuning, the same flags as [`meshllm router`](#meshllm-router)'s "
                "(ignored with `--router-address`)",
            ),
        ),
    ),
    "router": Table("docs/operations.md", _now(lambda: router_arg_parser(env={})), skip_groups=(*PLANES, *CREDENTIALS)),
    "worker": Table("docs/operations.md", _now(lambda: worker_arg_parser("mocker", env={})), skip_groups=(*PLANES, *CREDENTIALS)),
    "mocker": Table("docs/operations.md", functools.partial(engine_parser, "mocker"), without=_worker_flags("mocker")),
    "sample": Table("docs/operations.md", functools.partial(engine_parser, "sample"), without=_worker_flags("sample")),
    "planner": Table("docs/planner.md", _now(lambda: planner_arg_parser(env={})), skip_groups=("etcd TLS and authentication",)),
    "planner-profile": Table("docs/planner.md", _now(lambda: profile_arg_parser(env={}))),
    **{
        name: Table(f"docs/engines/{name}.md", functools.partial(engine_parser, name), without=_worker_flags(name))
        for name in ("llamacpp", "vllm", "trtllm")
    },
}


async def tables(names: Sequence[str] = ()) -> dict[str, tuple[Table, str]]:
    """Each table (or those named) with its Markdown, from a fresh parser."""
    out = {}
    for name, spec in TABLES.items():
        if not names or name in names:
            out[name] = (spec, table(spec, await spec.parser()))
    return out


async def rewrite(root: Path = ROOT, *, check: bool = False) -> list[str]:
    """Write every doc's tables (or, with `check`, only compare); the docs that were (or would be) changed."""
    made = await tables()
    changed = []
    for doc in sorted({spec.doc for spec, _ in made.values()}):
        path = root / doc
        text = path.read_text()
        new = render(text, {name: md for name, (spec, md) in made.items() if spec.doc == doc})
        missing = [n for n, (spec, _) in made.items() if spec.doc == doc and f"<!-- flags: {n} -->" not in text]
        if missing:
            raise KeyError(f"{doc} has no marker for the flag table(s) {', '.join(missing)}")
        if new != text:
            changed.append(doc)
            if not check:
                path.write_text(new)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshllm.flag_docs", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say which docs are stale (exit 1 if any)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout's)")
    args = ap.parse_args(argv)
    changed = asyncio.run(rewrite(args.root, check=args.check))
    for doc in changed:
        print(f"{doc}: {'stale (run python -m meshllm.flag_docs)' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
