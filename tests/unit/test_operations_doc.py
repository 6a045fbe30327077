"""docs/operations.md cannot rot: every flag, its MESHLLM_* variable and every metric is documented.

Builds each command's real parser (`meshllm run`, `frontend`, `router`, the
worker's common flags, the mocker and sample engines' own flags) and each
service's metrics registry, and checks that the doc's section for that
command names every long option and its variable, and that the metrics
section names every metric as it is exposed (counters with `_total`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from meshllm.config import env_name
from meshllm.engine.worker_config import worker_arg_parser
from meshllm.flag_docs import engine_parser, plane_parser
from meshllm.frontend.config import frontend_arg_parser
from meshllm.frontend.metrics import FrontendMetrics
from meshllm.router.config import router_arg_parser
from meshllm.router.metrics import RouterMetrics
from meshllm.run import run_arg_parser
from meshllm.worker.metrics import WorkerMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"

PLANES = "### Discovery and events (frontend, router, worker)"
RUN, FRONTEND, ROUTER, WORKER = "### `meshllm run`", "### `meshllm frontend`", "### `meshllm router`", "### `meshllm worker`"


def sections() -> dict[str, str]:
    """Heading line → the text up to the next heading of any level."""
    out: dict[str, str] = {}
    heading, lines = "", []
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            out[heading] = "\n".join(lines)
            heading, lines = line.strip(), []
        else:
            lines.append(line)
    out[heading] = "\n".join(lines)
    return out


def options(parser: argparse.ArgumentParser, *, without: argparse.ArgumentParser | None = None) -> list[list[str]]:
    """The long option strings of each action (help excluded), minus those `without` also has."""
    skip = {o for a in without._actions for o in a.option_strings} if without is not None else set()
    found = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if longs and not set(longs) & skip:
            found.append(longs)
    return found


def missing(found: list[list[str]], *headings: str) -> list[str]:
    """Options (or their variables) that none of `headings`' sections mention."""
    docs = sections()
    for h in headings:
        assert h in docs, f"docs/operations.md has no section {h!r}"
    text = "\n".join(docs[h] for h in headings)
    problems = [f"{o} (in {' / '.join(headings)})" for longs in found for o in longs if f"`{o}`" not in text]
    problems += [f"{env_name(longs[0])} (in {' / '.join(headings)})" for longs in found if f"`{env_name(longs[0])}`" not in text]
    return problems


def test_every_plane_flag_and_variable_is_documented() -> None:
    assert not missing(options(plane_parser()), PLANES)


@pytest.mark.parametrize(
    ("parser", "heading"),
    [
        (run_arg_parser(env={}), RUN),
        (frontend_arg_parser(env={}), FRONTEND),
        (router_arg_parser(env={}), ROUTER),
        (worker_arg_parser("any", env={}), WORKER),
    ],
    ids=["run", "frontend", "router", "worker"],
)
def test_every_flag_of_each_command_is_documented_in_its_section(parser: argparse.ArgumentParser, heading: str) -> None:
    assert not missing(options(parser, without=plane_parser()), heading)


def test_the_worker_engine_flag_is_documented() -> None:
    assert not missing([["--engine"]], WORKER)


@pytest.mark.parametrize("engine", ["mocker", "sample"])
async def test_every_engine_flag_is_documented_in_the_engines_section(engine: str) -> None:
    parser = await engine_parser(engine)
    own = options(parser, without=worker_arg_parser(engine, env={}))
    assert own, f"{engine} adds no flags of its own?"
    assert not missing(own, f"#### `{engine}` engine flags")


def exposed_names(registry: object) -> set[str]:
    names = set()
    for family in registry.collect():  # type: ignore[attr-defined]
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


@pytest.mark.parametrize(
    ("registry", "heading"),
    [
        (FrontendMetrics().registry, "### Frontend"),
        (RouterMetrics("r").registry, "### Router"),
        (WorkerMetrics("w").registry, "### Worker"),
    ],
    ids=["frontend", "router", "worker"],
)
def test_every_metric_is_documented_with_its_exposed_name(registry: object, heading: str) -> None:
    text = sections()[heading]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    assert exposed_names(registry) == documented
