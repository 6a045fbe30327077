"""deploy/compose.yaml as data: services, profiles, ports, dependencies (shared by the compose and manifest tests)."""

from __future__ import annotations

import os
import re
from typing import Any

import yaml
from mesh_run import ROOT

DEPLOY = ROOT / "deploy"


def load_compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return compose


def active(compose: dict[str, Any], profiles: frozenset[str] | set[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """The services `docker compose --profile P ... up` starts: those without profiles, and those of `profiles`."""
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or set(s["profiles"]) & profiles}


def default_profile(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return active(compose)


def is_meshllm(svc: dict[str, Any]) -> bool:
    return bool(svc.get("command")) and svc["command"][0] == "meshllm"


def is_job(svc: dict[str, Any]) -> bool:
    """A one-shot job of the image (init, etcd-auth): runs to completion before its dependents start."""
    return str(svc.get("restart")) == "no" and bool(svc.get("command")) and svc["command"][0] in ("python", "python3")


def role_of(svc: dict[str, Any]) -> str:
    """frontend | router | worker: the meshllm subcommand."""
    return str(svc["command"][1])


def published_ports(svc: dict[str, Any]) -> list[int]:
    """Container ports of `ports: ["[IP:]HOST:CONTAINER", ...]`."""
    return [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])]


def listened_ports(svc: dict[str, Any]) -> list[int]:
    """Published and `expose`d container ports."""
    return published_ports(svc) + [int(str(p).split("/")[0]) for p in svc.get("expose", [])]


def depends_on(svc: dict[str, Any]) -> list[str]:
    deps = svc.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` from this process's environment (MESHLLM_* ignored, as clean_env does)."""

    def sub(m: re.Match[str]) -> str:
        name, default = m[1], m[2] or ""
        return default if name.startswith("MESHLLM_") else os.environ.get(name) or default

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, value)
