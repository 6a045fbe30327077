"""py-spy sampling of running mesh processes, summarised as their top frames (percent of samples).

`Profiler.start` attaches `py-spy record -f raw --nonblocking --subprocesses`
to each process (nonblocking: the target is never paused, so its timing is not
disturbed beyond the sampler's own CPU; subprocesses: a service that forks
workers is sampled whole); `Profiler.stop` sends SIGINT, which
makes py-spy write its collapsed stacks, and summarises them. Self time is the
innermost frame of each sample; inclusive time counts a frame once per sample
that has it anywhere below the event loop (or a thread's entry) on its stack, shown for meshllm's own frames
(the entry-point frames above the loop are in every sample and say nothing). Self time is also summed by
package (`grpc`, `uvicorn`, `asyncio`, `meshllm/frontend`, ...).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Profile", "Profiler", "package_of", "py_spy_binary", "short_frame", "summarise_raw"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")
_ROOTS = ("site-packages/", "dist-packages/")
_LOOP_FRAMES = ("asyncio/runners.py Runner.run", "asyncio/events.py Handle._run")


def short_frame(frame: str) -> str:
    """'func (/x/site-packages/grpc/aio/_call.py:12)' → 'grpc/aio/_call.py func' (line dropped)."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    path = m["file"]
    for root in _ROOTS:
        if root in path:
            path = path.rsplit(root, 1)[1]
            break
    else:
        if "/meshllm/" in path:
            path = "meshllm/" + path.rsplit("/meshllm/", 1)[1]
        elif m2 := re.search(r"/lib/python3\.\d+/(.*)$", path):
            path = m2[1]
    return f"{path} {m['func']}"


@dataclass(frozen=True, slots=True)
class Profile:
    """One process's samples: the top frames by self time and meshllm's frames by inclusive time (percent)."""

    samples: int
    self_top: list[tuple[float, str]]
    meshllm_inclusive: list[tuple[float, str]]
    by_package: list[tuple[float, str]] = field(default_factory=list)


def package_of(frame: str) -> str:
    """'grpc/aio/_call.py f' → 'grpc'; 'meshllm/frontend/http/app.py f' → 'meshllm/frontend'; 'selectors.py f' → 'selectors'."""
    parts = frame.split(" ", 1)[0].split("/")
    if parts[0] == "meshllm" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0].removesuffix(".py")


def summarise_raw(text: str, *, top: int = 10) -> Profile:
    """Summarise py-spy's raw (collapsed) output: one 'frame;frame;...;frame COUNT' line per distinct stack."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    pkg_counts: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [short_frame(f) for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        total += n
        self_counts[frames[-1]] += n
        pkg_counts[package_of(frames[-1])] += n
        below = max((i + 1 for i, f in enumerate(frames) if f in _LOOP_FRAMES), default=0)
        for f in set(frames[below:]):
            if f.startswith("meshllm/"):
                incl_counts[f] += n
    if total == 0:
        return Profile(0, [], [])

    def pct(counts: Counter[str]) -> list[tuple[float, str]]:
        return [(100.0 * n / total, f) for f, n in counts.most_common(top)]

    return Profile(total, pct(self_counts), pct(incl_counts), pct(pkg_counts))


def py_spy_binary() -> str:
    """py-spy next to this interpreter (the venv), else on PATH; RuntimeError when missing."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--profile needs py-spy: .venv/bin/pip install py-spy")
    return found


class Profiler:
    """py-spy on several processes for the span of one level."""

    def __init__(self, out_dir: Path, *, rate_hz: int = 200) -> None:
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self._running: dict[str, tuple[asyncio.subprocess.Process, Path]] = {}

    async def start(self, targets: Mapping[str, int]) -> None:
        binary = py_spy_binary()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in targets.items():
            slug = re.sub(r"\W+", "-", name)
            out = self.out_dir / f"{slug}.raw"
            proc = await asyncio.create_subprocess_exec(
                binary, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--format", "raw",
                "--nonblocking", "--subprocesses", "--duration", "3600", "--output", str(out),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            self._running[name] = (proc, out)

    async def stop(self) -> dict[str, Profile]:
        """SIGINT every sampler, wait for its output, summarise (an empty Profile when py-spy wrote nothing)."""
        running, self._running = self._running, {}
        for proc, _ in running.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
        profiles = {}
        for name, (proc, out) in running.items():
            try:
                _, err = await asyncio.wait_for(proc.communicate(), 60)
            except TimeoutError:
                proc.kill()
                _, err = await proc.communicate()
            if out.exists():
                profiles[name] = summarise_raw(out.read_text())
            else:
                print(f"    py-spy wrote nothing for {name}: {err.decode(errors='replace')[-500:]}", flush=True)
                profiles[name] = Profile(0, [], [])
        return profiles
