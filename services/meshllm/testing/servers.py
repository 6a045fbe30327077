"""Start real `etcd` and `nats-server` binaries on free loopback ports.

    async with EtcdServer() as etcd:          # etcd.endpoint == "127.0.0.1:PORT"
        ...
        await etcd.restart()                   # same port; data kept unless wipe=True
    async with NatsServer() as nats:           # nats.url == "nats://127.0.0.1:PORT"
        await nats.restart()

Each server gets its own temporary data directory, removed on close. Start
waits until the server answers (etcd `/health`, NATS `INFO` banner), never on
a fixed sleep. `kill()` is `SIGKILL` for fault tests.

Secured servers (certificates from `meshllm.certs.make_dev_pki`):

    async with EtcdServer(tls=pki_files["etcd"], users={"meshllm": "pw"}) as etcd:
        ...                                    # https, --client-cert-auth, auth enabled
    async with NatsServer(tls=pki_files["nats"], token="s3cret") as nats:
        ...                                    # --tlsverify; or users= / nkeys=
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from meshllm.testing.server_process import ServerBinaryMissing, ServerProcess, find_binary, free_port

if TYPE_CHECKING:
    from meshllm.certs import CertFiles

__all__ = ["EtcdServer", "NatsServer", "ServerBinaryMissing", "free_port", "nkey_user"]


def nkey_user(seed_file: str | os.PathLike[str]) -> str:
    """Write a new NATS user NKey seed (`SU...`) to `seed_file` (0600) and return its public key (`U...`)."""
    import nkeys  # nats-py's [nkeys] extra

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    fd = os.open(seed_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    public: bytes = nkeys.from_seed(bytearray(seed)).public_key
    return public.decode()


def _client_ssl(tls: CertFiles) -> ssl.SSLContext:
    """A client context trusting the test CA and presenting `tls`'s certificate (it has clientAuth usage)."""
    ctx = ssl.create_default_context(cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    return ctx


async def _http_get(port: int, path: str, tls: CertFiles | None) -> bytes:
    """The raw response to `GET path` on 127.0.0.1:port (b"" when it cannot be had)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=_client_ssl(tls) if tls else None), 2.0
        )
    except (OSError, TimeoutError):
        return b""
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 2.0)
    except (OSError, TimeoutError):
        return b""
    finally:
        writer.close()


class EtcdServer(ServerProcess):
    """A real single-node etcd on 127.0.0.1 with ephemeral client and peer ports.

    `tls`: serve https with that certificate, and require client certificates
    from its CA (`client_cert_auth`). `users`: after the first start create
    the root user (password `root_password`) and each user with a role that
    may read and write keys under `prefix`, then enable auth. Auth tokens
    expire after `auth_token_ttl_s` without use.
    """

    name = "etcd"

    def __init__(
        self,
        *,
        tls: CertFiles | None = None,
        client_cert_auth: bool = True,
        users: Mapping[str, str] | None = None,
        prefix: str = "meshllm/",
        auth_token_ttl_s: int = 300,
        ready_timeout_s: float = 20.0,
    ) -> None:
        super().__init__(ready_timeout_s=ready_timeout_s)
        self.binary = find_binary("etcd")
        self.auth_token_ttl_s = auth_token_ttl_s
        self.port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.users = dict(users or {})
        self.prefix = prefix
        self.root_password = "root-" + os.urandom(6).hex()

    def _new_ports(self) -> bool:
        self.port, self.peer_port = free_port(), free_port()
        shutil.rmtree(self._tmp / "data", ignore_errors=True)  # a member bootstrapped with the old peer URL
        return True

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The client URL (`https://` with TLS)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        client = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name", "meshllm-test",
            "--data-dir", str(self._tmp / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"meshllm-test={peer}",
            "--log-level", "warn",
            "--auth-token-ttl", str(self.auth_token_ttl_s),
        ]  # fmt: skip
        if self.tls:
            argv += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key), "--trusted-ca-file", str(self.tls.ca)]
            if self.client_cert_auth:
                argv.append("--client-cert-auth")
        return argv

    async def _probe(self) -> bool:
        return b'"health":"true"' in await _http_get(self.port, "/health", self.tls)

    async def _started(self) -> None:
        if self.users:
            await self._enable_auth()

    async def _enable_auth(self) -> None:
        from aetcd.rpc import auth_pb2, rpc_pb2, rpc_pb2_grpc  # the etcd v3 API as aetcd ships it

        if self.tls:
            creds = grpc.ssl_channel_credentials(self.tls.ca.read_bytes(), self.tls.key.read_bytes(), self.tls.cert.read_bytes())
            channel = grpc.aio.secure_channel(self.endpoint, creds)
        else:
            channel = grpc.aio.insecure_channel(self.endpoint)
        async with channel:
            auth = rpc_pb2_grpc.AuthStub(channel)
            await auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password=self.root_password), timeout=5)
            await auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="root"), timeout=5)
            await auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            prefix = self.prefix.encode()
            end = prefix[:-1] + bytes([prefix[-1] + 1])
            for user, password in self.users.items():
                role = f"{user}-rw"
                await auth.UserAdd(rpc_pb2.AuthUserAddRequest(name=user, password=password), timeout=5)
                await auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name=role), timeout=5)
                perm = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=prefix, range_end=end)
                await auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=perm), timeout=5)
                await auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role), timeout=5)
            await auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=5)

    def _wipe_data(self) -> None:
        shutil.rmtree(self._tmp / "data", ignore_errors=True)
        self._set_up = False  # a wiped etcd has no users: set them up again


class NatsServer(ServerProcess):
    """A real nats-server (JetStream off) on 127.0.0.1 with an ephemeral port.

    `tls`: require TLS with that certificate and (`verify`) client
    certificates from its CA. One way of authenticating: `token`, `users`
    ({user: password}) or `nkeys` (public user NKeys, `U...`).
    """

    name = "nats"

    def __init__(
        self,
        *,
        tls: CertFiles | None = None,
        verify: bool = True,
        token: str | None = None,
        users: Mapping[str, str] | None = None,
        nkeys: Sequence[str] = (),
        ready_timeout_s: float = 20.0,
    ) -> None:
        super().__init__(ready_timeout_s=ready_timeout_s)
        if sum(bool(x) for x in (token, users, nkeys)) > 1:
            raise ValueError("nats-server takes one of token, users, nkeys")
        self.binary = find_binary("nats-server")
        self.port = free_port()
        self.tls = tls
        self.verify = verify
        self.token = token
        self.users = dict(users or {})
        self.nkeys = list(nkeys)

    def _new_ports(self) -> bool:
        self.port = free_port()
        return True

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _config(self) -> str:
        """nats-server's configuration file (JSON is valid in its format)."""
        conf: dict[str, object] = {"listen": f"127.0.0.1:{self.port}"}
        if self.tls:
            conf["tls"] = {
                "cert_file": str(self.tls.cert),
                "key_file": str(self.tls.key),
                "ca_file": str(self.tls.ca),
                "verify": self.verify,
                "timeout": 5,
            }
        if self.token:
            conf["authorization"] = {"token": self.token}
        elif self.users:
            conf["authorization"] = {"users": [{"user": u, "password": p} for u, p in self.users.items()]}
        elif self.nkeys:
            conf["authorization"] = {"users": [{"nkey": k} for k in self.nkeys]}
        path = self._tmp / "nats.conf"
        path.write_text(json.dumps(conf, indent=2))
        return str(path)

    def _argv(self) -> list[str]:
        return [self.binary, "-c", self._config()]

    async def _probe(self) -> bool:
        # The INFO banner comes in plaintext, with or without TLS.
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 1.0)
        except (OSError, TimeoutError):
            return False
        try:
            line = await asyncio.wait_for(reader.readline(), 2.0)
            return line.startswith(b"INFO ")
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
