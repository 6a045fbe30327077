"""The package builds as a wheel (`python -m build`) that holds every file of `services/meshllm` and runs on its own.

Locks: a wheel built from a clean copy of the sources carries every module
and data file (a template, a page or a .pyi left out would break `pip
install .` users only), the `meshllm` command and the `llamacpp` extra pinned
to the llama-cpp-python the engine is tested with; installed alone into an
empty directory, `meshllm --version` runs from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "meshllm"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the dev extra installs `build` (pip install -e '.[dev]')")
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "setup.py", src)  # the KV index's C extension
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "services", src / "services", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (whl,) = out.glob("meshllm-*.whl")
    return whl


def test_the_wheel_holds_every_file_of_the_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            rel = Path(root, f).relative_to(PACKAGE.parent).as_posix()
            if not f.endswith(".pyc") and rel not in names:
                missing.append(rel)
    assert not missing, f"left out of the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_the_wheel_declares_the_command_and_the_llamacpp_extra(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    dist_info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert "meshllm = meshllm.cli:main" in entry_points
    meta = Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
    assert "llamacpp" in meta.get_all("Provides-Extra", [])
    assert any(r.replace(" ", "").startswith("llama-cpp-python==0.3.36;") for r in meta.get_all("Requires-Dist", []))


def test_the_installed_wheel_runs_on_its_own(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # only the installed copy of meshllm on the path (its dependencies still come from this environment)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); import meshllm, meshllm.cli; "
         "print(meshllm.__file__); sys.exit(meshllm.cli.main(['--version']))"],
        capture_output=True, text=True, timeout=60, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    first, version = run.stdout.splitlines()[:2]
    assert first.startswith(str(target)) and version.startswith("meshllm ")
