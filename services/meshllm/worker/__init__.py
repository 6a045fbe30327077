"""The worker: one engine behind the Worker gRPC service (`meshllm worker`).

Engines packaged outside meshllm start a worker with `meshllm.worker.run(MyEngine)`.
"""

from meshllm.worker.main import run

__all__ = ["run"]
