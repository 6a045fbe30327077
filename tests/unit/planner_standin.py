"""A stand-in for `meshllm worker` that the planner's local connector can start, drain and kill, for tests.

The stand-in is a real process (`python STANDIN`): it records its argv and pid in `OUT/ID.json` once its
SIGTERM handler is installed, then waits on a control FIFO `OUT/ID.ctl`. What the test writes to the FIFO is an
exit status to exit with by itself. On SIGTERM it touches `OUT/ID.term`, then by `--on-term`: `exit` (status 0
at once), `hold` (drains until the test writes to the FIFO, then status 0) or `ignore` (keeps running: only
SIGKILL ends it). With `--refuse MESSAGE` it prints two lines, the last `meshllm worker: error: MESSAGE`, and
exits with status 2 at once, as `meshllm worker` refusing its flags does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from meshllm.testing.waiting import wait_until

SCRIPT = r"""
import argparse, json, os, signal, sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--on-term", choices=("exit", "hold", "ignore"), default="exit")
parser.add_argument("--refuse", default="")
parser.add_argument("--role", required=True)
parser.add_argument("--instance-id", required=True)
args = parser.parse_args()
if args.refuse:
    print("loading the engine", flush=True)
    print(f"meshllm worker: error: {args.refuse}", flush=True)
    sys.exit(2)
out = Path(args.out)
ctl = out / f"{args.instance_id}.ctl"
os.mkfifo(ctl)


class Term(Exception):
    pass


def on_term(signum, frame):
    (out / f"{args.instance_id}.term").touch()
    if args.on_term != "ignore":
        raise Term


signal.signal(signal.SIGTERM, on_term)
ready = out / f"{args.instance_id}.tmp"
ready.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}))
ready.rename(out / f"{args.instance_id}.json")
try:
    while True:
        with open(ctl) as f:
            command = f.read().strip()
        if command:
            sys.exit(int(command))
except Term:
    if args.on_term == "hold":
        with open(ctl) as f:
            f.read()
    sys.exit(0)
"""


class Standins:
    """Where the stand-ins write, how to start them (`command`, `flags`) and how to talk to them."""

    def __init__(self, root: Path) -> None:
        self.out = root / "standins"
        self.out.mkdir()
        self.logs = root / "logs"
        self.script = root / "standin.py"
        self.script.write_text(SCRIPT)
        self.command = (sys.executable, str(self.script))

    def flags(self, on_term: str = "exit", refuse: str = "") -> list[str]:
        flags = ["--out", str(self.out), "--on-term", on_term]
        return [*flags, "--refuse", refuse] if refuse else flags

    async def ready(self, instance_id: str) -> dict[str, Any]:
        """Its record ({"pid", "argv"}) once it has installed its SIGTERM handler."""
        path = self.out / f"{instance_id}.json"
        await wait_until(path.exists, timeout_s=20, what=f"stand-in {instance_id} to start")
        record: dict[str, Any] = json.loads(path.read_text())
        return record

    def got_sigterm(self, instance_id: str) -> bool:
        return (self.out / f"{instance_id}.term").exists()

    async def tell(self, instance_id: str, command: str = "") -> None:
        """Write `command` to its control FIFO (an exit status, or "" to end a held drain)."""
        fifo = self.out / f"{instance_id}.ctl"
        fds: list[int] = []

        def opened() -> bool:
            try:
                fds.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                if exc.errno not in (errno.ENXIO, errno.ENOENT):  # ENXIO: it has not opened its end yet
                    raise
                return False
            return True

        await wait_until(opened, timeout_s=20, what=f"stand-in {instance_id} to read its control FIFO")
        try:
            os.write(fds[0], command.encode())
        finally:
            os.close(fds[0])

    def kill_all(self) -> None:
        """SIGKILL every stand-in still running (a test's cleanup)."""
        for path in self.out.glob("*.json"):
            pid = json.loads(path.read_text())["pid"]
            if running(pid, path.stem):
                os.kill(pid, signal.SIGKILL)


def running(pid: int, instance_id: str) -> bool:
    """Whether `pid` runs and is the stand-in `instance_id` (a zombie or a reused pid is not)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return instance_id.encode() in cmdline.split(b"\0")
