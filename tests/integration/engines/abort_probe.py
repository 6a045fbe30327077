"""An engine living outside services/ (loaded with --engine abort_probe:AbortProbeEngine).

It is the sample engine plus one observable side effect: `abort()` appends the
request id to the file named by $ABORT_PROBE_FILE, so a test in another
process can see that the engine observed a cancellation.
"""

from __future__ import annotations

import asyncio
import os

from meshllm.engine.base import Context
from meshllm.engine.sample import SampleEngine


class AbortProbeEngine(SampleEngine):
    async def abort(self, context: Context) -> None:
        path = os.environ.get("ABORT_PROBE_FILE")
        if path:
            await asyncio.to_thread(_append, path, context.id + "\n")


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)
