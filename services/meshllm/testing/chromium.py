"""Headless Chromium driven over the DevTools protocol on a pipe, for browser tests (stdlib only).

    async with Chromium.start() as browser:
        page = await browser.open("http://127.0.0.1:8000/dashboard")
        rows = await page.evaluate("document.querySelectorAll('tr').length")
        png = await page.screenshot()
        assert not page.errors                 # console errors, uncaught exceptions, failed loads

`--remote-debugging-pipe` makes Chromium read DevTools commands from fd 3
and write answers and events to fd 4, each message JSON ended by a NUL: no
port, no websocket client. Each page is a target attached in flattened mode
(its messages carry a sessionId). A page's `errors` collects what a person
would see as red in the console: `console.error`, uncaught exceptions, and
log entries at level error (a resource that failed to load).

`find_chromium()` names the binary (Debian's `chromium`), or None.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import orjson

__all__ = ["Chromium", "Page", "find_chromium"]

COMMAND_TIMEOUT_S = 15.0


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class Page:
    """One tab: evaluate script, take screenshots, read the errors it logged."""

    def __init__(self, browser: Chromium, session_id: str) -> None:
        self.browser = browser
        self.session_id = session_id
        self.errors: list[str] = []
        self.loaded = asyncio.Event()  # set by each load event

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.send(method, params, session_id=self.session_id)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited); AssertionError when it throws."""
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self) -> bytes:
        """The page as PNG, the full scrollable height."""
        height = await self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        width = await self.evaluate("Math.ceil(document.documentElement.scrollWidth)")
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        result = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
        return base64.b64decode(result["data"])

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.loadEventFired":
            self.loaded.set()
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", ()))
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())


class Chromium:
    """A headless Chromium process and its DevTools pipe. Use `Chromium.start()`."""

    def __init__(self, binary: str, proc: subprocess.Popen[bytes], reader: asyncio.StreamReader, write_fd: int) -> None:
        self.binary = binary
        self.proc = proc
        self._reader = reader
        self._write_fd = write_fd
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}
        self._pump = asyncio.create_task(self._read(), name="chromium-devtools")

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, *, width: int = 1440, height: int = 900) -> AsyncIterator[Chromium]:
        """Start headless Chromium (a fresh profile); stop it on exit."""
        binary = find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium binary on PATH (Debian: apt-get install chromium)")
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        profile = tempfile.mkdtemp(prefix="meshllm-chromium-")
        flags = [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--mute-audio",
            f"--window-size={width},{height}", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank",
        ]  # fmt: skip
        # The pipe must be fds 3 (commands in) and 4 (answers out) in the child: a small exec wrapper moves them there.
        wrapper = "import os, sys; a = sys.argv; os.dup2(int(a[1]), 3); os.dup2(int(a[2]), 4); os.execv(a[3], a[3:])"
        proc = subprocess.Popen(  # noqa: ASYNC220  # returns at once; the pipe is read asynchronously
            [sys.executable, "-c", wrapper, str(to_chrome_r), str(from_chrome_w), binary, *flags],
            pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_chrome_r, "rb", buffering=0)
        )
        browser = cls(binary, proc, reader, to_chrome_w)
        try:
            await browser.send("Browser.getVersion")
            yield browser
        finally:
            browser._pump.cancel()
            with contextlib.suppress(OSError):
                os.close(to_chrome_w)
            transport.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
                except TimeoutError:
                    proc.kill()
                    await asyncio.to_thread(proc.wait)
            shutil.rmtree(profile, ignore_errors=True)

    async def send(self, method: str, params: dict[str, Any] | None = None, *, session_id: str | None = None) -> dict[str, Any]:
        """One DevTools command and its result; AssertionError on a protocol error."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session_id is not None:
            msg["sessionId"] = session_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = fut
        os.write(self._write_fd, orjson.dumps(msg) + b"\0")
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT_S):
                answer = await fut
        finally:
            self._waiting.pop(msg["id"], None)
        if "error" in answer:
            raise AssertionError(f"DevTools {method} failed: {answer['error']}")
        return dict(answer.get("result", {}))

    async def open(self, url: str) -> Page:
        """A new tab with console and log capture on, navigated to `url` (returns once the load event fired)."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = self._pages[attached["sessionId"]] = Page(self, attached["sessionId"])
        for domain in ("Runtime", "Log", "Page"):
            await page.send(f"{domain}.enable")
        page.loaded.clear()
        result = await page.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise AssertionError(f"cannot load {url}: {result['errorText']}")
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await page.loaded.wait()
        return page

    async def _read(self) -> None:
        while True:
            try:
                raw = await self._reader.readuntil(b"\0")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                for pending in self._waiting.values():
                    if not pending.done():
                        pending.set_exception(AssertionError(f"chromium closed its DevTools pipe (exit {self.proc.poll()})"))
                return
            msg = orjson.loads(raw[:-1])
            if "id" in msg:
                fut = self._waiting.get(msg["id"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif (page := self._pages.get(msg.get("sessionId", ""))) is not None:
                page.on_event(msg.get("method", ""), msg.get("params", {}))
