"""The import direction docs/architecture.md ("Dependency direction") promises, checked on the code's own imports.

Every module under services/meshllm is parsed with `ast`; every `import` and
`from ... import` counts wherever it is written: at module level, under
`TYPE_CHECKING`, or inside a function (a lazy import still means the module
knows the one it imports). A module belongs to a *unit*: its subpackage of
`meshllm` (`meshllm.engine.llamacpp.files` → `engine`) or, for a top-level
module, its own name (`meshllm.config` → `config`). A unit may import itself
and what `ALLOWED` lists for it; an entry in `ALLOWED` names a unit
(`plane`) or one module of it (`worker.client`, which allows it and its
submodules only).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"

#: Units everything may build on: the generated protobuf code, the root
#: package (`__version__`) and the small leaf modules (errors, credentials,
#: config, tracing, ports, lifecycle, logs).
FOUNDATION = ("v1", "meshllm", "errors", "flags", "credentials", "config", "tracing", "ports", "lifecycle", "logs")

#: The allowed dependencies of each unit (docs/architecture.md, "Dependency
#: direction"). "*" marks an entry point: it may import anything, and since no
#: other unit lists it, nothing imports it.
ALLOWED: Mapping[str, tuple[str, ...]] = {
    "v1": (),
    "meshllm": (),
    "errors": (),
    "logs": (),
    "heap": (),
    "served_counts": (),
    "tracing": ("logs",),
    "credentials": ("errors", "flags"),
    "flags": (),
    "config": ("errors", "flags", "credentials", "logs"),
    "ports": ("config",),
    "lifecycle": ("config", "errors", "heap", "tracing"),
    "protocol": ("v1", "errors"),
    "tokenizers": ("config", "errors"),
    "plane": (*FOUNDATION, "protocol"),
    "engine": ("protocol", "errors", "config", "tokenizers"),
    "worker": (*FOUNDATION, "protocol", "plane", "engine"),
    "router": (*FOUNDATION, "protocol", "plane", "worker.client"),
    # A frontend may embed a routing core (router modes "kv"/"round-robin" in process).
    "frontend": (*FOUNDATION, "protocol", "plane", "tokenizers", "router", "worker.client", "served_counts"),
    # The planner reads frontends' /metrics (served_counts) and the router's workers; `meshllm planner profile`
    # loads a worker with the load generator (bench).
    "planner": (*FOUNDATION, "protocol", "plane", "router.client", "served_counts", "bench"),
    "cli": ("*",),
    "__main__": ("*",),
    "run": ("*",),
    "flag_docs": ("*",),
    "completion": ("*",),
    "health": ("*",),
    "certs": ("*",),
    "bench": ("*",),
    "testing": ("*",),
}

#: Single imports that break the table, each with the reason it stays.
EXCEPTIONS: Mapping[tuple[str, str], str] = {
    ("meshllm.engine.worker_config", "meshllm.plane.auth"): (
        "WorkerConfig (the worker's flags, beside the engine contract whose engines parse them) carries the mesh "
        "security flags; the engine itself never uses them"
    ),
}

#: The plane's base modules and the backends that build on them: a base module imports none of them (backends
#: register an opener by kind; meshllm.plane.backends is the one module that knows them).
PLANE_BASES = ("meshllm.plane.discovery.base", "meshllm.plane.events.base")
PLANE_BACKENDS = (
    "meshllm.plane.discovery.etcd",
    "meshllm.plane.discovery.etcd_client",
    "meshllm.plane.discovery.retry",
    "meshllm.plane.events.nats",
    "meshllm.plane.events.nats_client",
    "meshllm.plane.backends",
)


@dataclass(frozen=True, slots=True)
class Violation:
    module: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement in `path`, lazy ones included."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            # `from meshllm.engine import base` imports the module meshllm.engine.base; `from meshllm.config
            # import X` imports meshllm.config.
            submodules = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}", root)]
            if len(submodules) < len(node.names):
                yield base, node.lineno
            for submodule in submodules:
                yield submodule, node.lineno


def _is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _allowed(target: str, entries: tuple[str, ...]) -> bool:
    rest = target.split(".", 1)[1] if "." in target else "meshllm"
    return any(rest == e or rest.startswith(e + ".") for e in entries)


def violations(
    root: Path,
    allowed: Mapping[str, tuple[str, ...]] = ALLOWED,
    exceptions: Mapping[tuple[str, str], str] = EXCEPTIONS,
    package: str = "meshllm",
) -> list[Violation]:
    """Every first-party import under `root/package` that the table does not allow."""
    found: list[Violation] = []
    for path in sorted((root / package).rglob("*.py")):
        module = module_name(path, root)
        unit = unit_of(module)
        entries = allowed.get(unit)
        if entries is None:
            found.append(Violation(module, f"<unit {unit!r} is missing from the layering table>", 0))
            continue
        for target, line in imports(path, root):
            if target != package and not target.startswith(package + "."):
                continue
            if "*" in entries or unit_of(target) == unit or _allowed(target, entries):
                continue
            if (module, target) in exceptions:
                continue
            found.append(Violation(module, target, line))
    return found


def test_the_services_follow_the_documented_direction() -> None:
    found = violations(SERVICES)
    assert not found, "imports against docs/architecture.md's dependency direction:\n" + "\n".join(map(str, found))


def test_every_exception_is_still_needed() -> None:
    """An exception the code no longer uses must leave the table (so the table never hides a new import)."""
    used = {(module_name(p, SERVICES), t) for p in (SERVICES / "meshllm").rglob("*.py") for t, _ in imports(p, SERVICES)}
    assert set(EXCEPTIONS) <= used, f"exceptions nothing needs: {sorted(set(EXCEPTIONS) - used)}"


def backend_imports(root: Path) -> list[str]:
    """Every import of a plane backend by a plane base module, lazy ones included."""
    found = []
    for base in PLANE_BASES:
        path = root.joinpath(*base.split(".")).with_suffix(".py")
        found += [f"{base}:{line} imports {t}" for t, line in imports(path, root) if t.startswith(PLANE_BACKENDS)]
    return found


def test_the_plane_base_modules_import_no_backend() -> None:
    found = backend_imports(SERVICES)
    assert not found, "a base module knows a backend (register it in meshllm.plane.backends instead):\n" + "\n".join(found)


def test_a_lazy_backend_import_in_a_base_module_is_found(tmp_path: Path) -> None:
    lazy = "async def open_discovery(config):\n    from meshllm.plane.discovery.etcd import EtcdDiscovery\n"
    files = {"meshllm/__init__.py": "", "meshllm/plane/__init__.py": "", "meshllm/plane/discovery/etcd.py": "",
             "meshllm/plane/events/base.py": "", "meshllm/plane/discovery/base.py": lazy}  # fmt: skip
    assert backend_imports(_tree(tmp_path, files)) == ["meshllm.plane.discovery.base:2 imports meshllm.plane.discovery.etcd"]


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


FIXTURE = {
    "meshllm/__init__.py": "",
    "meshllm/errors.py": "",
    "meshllm/config.py": "from meshllm.errors import *\n",
    "meshllm/protocol/__init__.py": "",
    "meshllm/protocol/types.py": "from meshllm import errors\n",
    "meshllm/engine/__init__.py": "",
    "meshllm/engine/base.py": "from meshllm.protocol.types import *\nfrom . import sample\n",
    "meshllm/engine/sample.py": "",
    "meshllm/worker/__init__.py": "",
    "meshllm/worker/client.py": "import meshllm.protocol.types\n",
    "meshllm/worker/service.py": "from meshllm.engine import base\n",
}


def test_a_clean_fixture_tree_passes(tmp_path: Path) -> None:
    assert violations(_tree(tmp_path, FIXTURE)) == []


@pytest.mark.parametrize(
    ("module", "source", "imported"),
    [
        # the engine reaching up to the worker, at module level
        ("meshllm/engine/base.py", "from meshllm.worker.client import WorkerClient\n", "meshllm.worker.client"),
        # the same, lazily inside a function
        ("meshllm/engine/sample.py", "def f():\n    import meshllm.worker.service\n", "meshllm.worker.service"),
        # a relative upward import
        ("meshllm/engine/sample.py", "from ..worker import service\n", "meshllm.worker.service"),
        # protocol reaching for the engine through `from package import module`
        ("meshllm/protocol/types.py", "from meshllm import engine\n", "meshllm.engine"),
    ],
)
def test_an_upward_import_fails_the_check(tmp_path: Path, module: str, source: str, imported: str) -> None:
    tree = _tree(tmp_path, {**FIXTURE, module: FIXTURE[module] + source})
    found = violations(tree)
    assert [v.imported for v in found] == [imported]
    assert found[0].module == module.removesuffix(".py").replace("/", ".")


def test_a_service_uses_another_only_through_its_client(tmp_path: Path) -> None:
    files = {**FIXTURE, "meshllm/router/__init__.py": "", "meshllm/router/core.py": "from meshllm.worker.service import x\n"}
    found = violations(_tree(tmp_path, files))
    assert [str(v) for v in found] == ["meshllm.router.core:1 imports meshllm.worker.service"]


def test_an_exception_allows_exactly_its_import(tmp_path: Path) -> None:
    files = {**FIXTURE, "meshllm/engine/sample.py": "import meshllm.worker.client\nimport meshllm.worker.service\n"}
    found = violations(_tree(tmp_path, files), exceptions={("meshllm.engine.sample", "meshllm.worker.client"): "test"})
    assert [v.imported for v in found] == ["meshllm.worker.service"]


def test_a_unit_missing_from_the_table_is_reported(tmp_path: Path) -> None:
    found = violations(_tree(tmp_path, {**FIXTURE, "meshllm/newthing.py": ""}))
    assert [v.module for v in found] == ["meshllm.newthing"]
