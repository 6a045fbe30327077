"""The build a mesh report names: Python, machine, git commit, package versions, and a fingerprint of the code
the services run (bench/mesh.py compares it at the end of a run to tell when someone edited services/ meanwhile)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
from pathlib import Path

from harness.runinfo import python, versions
from harness.systems import dynamo_venv

__all__ = ["PACKAGES", "build_info", "code_fingerprint"]

ROOT = Path(__file__).resolve().parents[2]  # the repository: bench/harness/buildinfo.py
PACKAGES = ("grpcio", "protobuf", "uvloop", "uvicorn", "tokenizers", "orjson", "nats-py", "aetcd", "py-spy")


def code_fingerprint() -> str:
    """A hash of the code the services run: HEAD, uncommitted changes and untracked files under services/."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=False).stdout

    h = hashlib.sha1(git("rev-parse", "HEAD") + git("diff", "HEAD", "--", "services"))
    for name in sorted(git("ls-files", "--others", "--exclude-standard", "--", "services").decode().splitlines()):
        with contextlib.suppress(OSError):
            h.update(name.encode() + (ROOT / name).read_bytes())
    return h.hexdigest()[:12]


def build_info() -> dict[str, str]:
    """Python, machine, git commit and package versions, read from this run."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    found = [v for v in (versions(*PACKAGES),) if v]
    dyn = dynamo_venv() / "bin" / "python"
    if dyn.exists():
        code = "import importlib.metadata as m; print(m.version('ai-dynamo'))"
        out = subprocess.run([str(dyn), "-c", code], capture_output=True, text=True, check=False).stdout.strip()
        if out:
            found.append(f"ai-dynamo {out}")
    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": python(),
        "commit": (git("rev-parse", "--short", "HEAD") or "unknown") + dirty,
        "packages": ", ".join(found),
        "fingerprint": code_fingerprint(),
    }
