"""The router: KV-aware routing, disaggregated prefill→decode, migration (`meshllm router`).

`RouterCore` is the library (also embeddable in a frontend process),
`RouterClient` the typed client of a remote router, `RouterConfig` their
configuration; `meshllm.router.main` is the process entry point.
"""

from __future__ import annotations

from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig, RouterMode
from meshllm.router.core import RouterCore

__all__ = ["RouterClient", "RouterConfig", "RouterCore", "RouterMode"]
