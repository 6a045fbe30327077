"""No import circle anywhere in services/ or bench/: beside the layering test, which only checks units.

Every import counts, wherever it is written (module level, `TYPE_CHECKING`, inside a function), as in
test_layering.py: a lazy import that "breaks" a circle at run time still means two modules know each other, and
neither can be read, tested or moved without the other. An import names the deepest module it reaches
(`from meshllm.router.core import RouterCore` → `meshllm.router.core`). bench/'s scripts import each other by
file name (`from routing_cases import Setup`) and its harness by package (`from harness.doc import publish`), as
they run with bench/ on sys.path.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

from test_layering import SERVICES, _is_module, imports, module_name

BENCH = SERVICES.parent / "bench"


def services_graph(root: Path, package: str = "meshllm") -> dict[str, set[str]]:
    """module → the first-party modules it imports (generated code under `v1/` left out: it imports only itself)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        if "v1" in path.relative_to(root / package).parts[:1]:
            continue
        name = module_name(path, root)
        targets = graph.setdefault(name, set())
        for imported, _ in imports(path, root):
            while imported and not _is_module(imported, root):
                imported = imported.rpartition(".")[0]
            if imported.startswith(package) and imported != name:
                targets.add(imported)
    return graph


def scripts_graph(root: Path) -> dict[str, set[str]]:
    """bench module → the bench modules it imports: scripts by file name (`routing_cases`), the modules of its
    packages by dotted name (`harness.doc`), as they run with bench/ on sys.path."""
    paths = {p.stem: p for p in sorted(root.glob("*.py"))}
    for init in sorted(root.glob("*/__init__.py")):
        paths |= {f"{init.parent.name}.{p.stem}": p for p in sorted(init.parent.glob("*.py")) if p != init}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            found: Iterable[str] = ()
            if isinstance(node, ast.Import):
                found = (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = (node.module, *(f"{node.module}.{a.name}" for a in node.names))
            for imported in found:
                while imported and imported not in paths:
                    imported = imported.rpartition(".")[0]
                if imported and imported != name:
                    targets.add(imported)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The graph's import circles: each strongly connected group of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    assert circles(services_graph(SERVICES)) == []


def test_no_bench_script_is_in_an_import_circle() -> None:
    assert circles(scripts_graph(BENCH)) == []


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_a_circle_through_a_lazy_or_type_only_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "meshllm/__init__.py": "",
            "meshllm/router/__init__.py": "",
            "meshllm/router/core.py": "from meshllm.router.stream.legs import stream_request\n",
            "meshllm/router/stream/legs.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshllm.router.core import RouterCore\n"
            ),
            "meshllm/router/recent.py": "def f():\n    from meshllm.router import core\n",
            "meshllm/v1/__init__.py": "from meshllm.v1 import x_pb2\n",
            "meshllm/v1/x_pb2.py": "import meshllm.v1\n",
        },
    )
    assert circles(services_graph(root)) == [["meshllm.router.core", "meshllm.router.stream.legs"]]


def test_a_circle_of_bench_scripts_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {"a.py": "from b import x\n", "b.py": "import c\n", "c.py": "from a import y\nimport json\n", "d.py": "import a\n"},
    )
    assert circles(scripts_graph(root)) == [["a", "b", "c"]]


def test_a_circle_through_a_bench_package_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "from h.x import f\n",
            "h/__init__.py": "",
            "h/x.py": "from h import y\n",
            "h/y.py": "import a\n",
            "b.py": "import h.y\n",
        },
    )
    assert circles(scripts_graph(root)) == [["a", "h.x", "h.y"]]
