"""Enable etcd's auth for the secure compose stack (deploy/compose.yaml's `etcd-auth` service).

    python deploy/init/etcd_auth.py --endpoint etcd:2379 --secrets /secrets

Creates the `root` user (password from etcd-root-password), the user `meshllm` (password from etcd-password)
with a role that may read and write only keys under `meshllm/`, then turns auth on. Connects with TLS and the
certificate certs/etcd-auth.pem (etcd runs with --client-cert-auth). Idempotent: an etcd whose auth is on
already is left as it is; users or roles that exist (a run cut short) are reused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc
from aetcd.rpc import auth_pb2, rpc_pb2, rpc_pb2_grpc  # the etcd v3 API as aetcd ships it

USER, ROLE = "meshllm", "meshllm-rw"


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    key = prefix.encode()
    return key, key[:-1] + bytes([key[-1] + 1])


async def _ignore_exists(call: object) -> None:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "already exists" not in (exc.details() or ""):
            raise


async def enable_auth(
    endpoint: str, secrets: Path, *, certs: Path | None = None, cert_name: str = "etcd-auth", prefix: str = "meshllm/"
) -> bool:
    """Set up users and enable auth; False when auth was on already."""
    certs = certs or secrets / "certs"
    creds = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(), (certs / f"{cert_name}-key.pem").read_bytes(), (certs / f"{cert_name}.pem").read_bytes()
    )
    async with grpc.aio.secure_channel(endpoint, creds) as channel:
        auth = rpc_pb2_grpc.AuthStub(channel)
        try:
            await auth.UserList(rpc_pb2.AuthUserListRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if "user name not found" in details or "permission denied" in details:
                return False  # auth is on: only root may list users, and this certificate's CN is not a user
            raise
        root_pw = (secrets / "etcd-root-password").read_text().strip()
        user_pw = (secrets / "etcd-password").read_text().strip()
        await _ignore_exists(auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password=root_pw), timeout=10))
        await _ignore_exists(auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="root"), timeout=10))
        await auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
        await _ignore_exists(auth.UserAdd(rpc_pb2.AuthUserAddRequest(name=USER, password=user_pw), timeout=10))
        await _ignore_exists(auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name=ROLE), timeout=10))
        key, end = _prefix_range(prefix)
        perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=key, range_end=end)
        await auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=ROLE, perm=perm), timeout=10)
        await auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=USER, role=ROLE), timeout=10)
        await auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=10)
        return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="etcd_auth", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default="etcd:2379", help="etcd client endpoint HOST:PORT (TLS)")
    parser.add_argument("--secrets", default="/secrets", help="directory of etcd-password and etcd-root-password")
    parser.add_argument("--certs", default="", help="directory of ca.pem and etcd-auth.pem/-key.pem (default SECRETS/certs)")
    ns = parser.parse_args(argv)
    try:
        enabled = asyncio.run(enable_auth(ns.endpoint, Path(ns.secrets), certs=Path(ns.certs) if ns.certs else None))
    except (OSError, grpc.aio.AioRpcError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        print(f"etcd_auth: error: {ns.endpoint}: {detail}", file=sys.stderr)
        return 1
    print("etcd auth enabled (users root, meshllm)" if enabled else "etcd auth was enabled already")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
