"""`HttpServer`: uvicorn (httptools) serving the ASGI app on a pre-bound socket, HTTPS with reloaded certificates."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

import uvicorn

from meshllm.frontend.http.guard import guarded_protocol
from meshllm.lifecycle import AsyncCloseable

if TYPE_CHECKING:
    from meshllm.frontend.http.app import OpenAIApp
    from meshllm.plane.tls import TlsConfig

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "HttpServer"]

DEFAULT_HEADER_TIMEOUT_S = 10.0


class HttpServer(AsyncCloseable):
    """uvicorn (httptools) serving an ASGI app on a pre-bound socket; close = graceful stop."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, reload: asyncio.Task[None] | None = None) -> None:
        self._server = server
        self._sock = sock
        self._reload = reload  # HTTPS: loads changed certificate files (plane/tls.py keep_reloaded)
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "https" if reload is not None else "http"

    @classmethod
    async def start(
        cls,
        app: OpenAIApp,
        host: str,
        port: int,
        *,
        graceful_s: float = 10.0,
        reuse_port: bool = False,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        tls: TlsConfig | None = None,
    ) -> HttpServer:
        """Serve `app` on host:port; `reuse_port` shares the port with the other processes of `--workers N`.

        `tls`: HTTPS (client certificates required when it has a CA), reloaded when its files change.

        A request's headers must arrive within `header_timeout_s`, its body within the app's `body_timeout_s`.
        """
        sock = _listen(host, port, reuse_port=reuse_port)
        config = uvicorn.Config(
            app,
            http=guarded_protocol(header_timeout_s=header_timeout_s, body_timeout_s=app.body_timeout_s),
            loop="none",
            lifespan="off",
            ws="none",
            interface="asgi3",
            access_log=False,
            log_config=None,
            server_header=False,
            date_header=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(1, round(graceful_s)),
            backlog=2048,
        )
        config.load()
        reload = None
        if tls is not None:
            from meshllm.plane.tls import TlsFiles, keep_reloaded, ssl_server_context

            files = TlsFiles(tls)
            config.ssl = ssl_server_context(files)
            reload = asyncio.create_task(keep_reloaded(config.ssl, files), name="https-cert-reload")
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        return cls(server, sock, reload)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        return f"{self.scheme}://{host}:{self.port}"

    async def _aclose(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
            await asyncio.gather(self._reload, return_exceptions=True)
        await self._server.shutdown(sockets=[self._sock])


def _listen(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening, non-blocking socket on host:port; a port that cannot be bound is one clear ConfigError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        from meshllm.ports import bind_error

        raise bind_error(host, port, "--http-port", exc) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock
