"""The llamacpp engine: real CPU inference on GGUF models through llama.cpp (llama-cpp-python).

`config` (flags), `sampling` (validated sampling options and grammars),
`openmp` (how llama.cpp's threads wait, set before it loads),
`sequence` (one request on the engine thread), `slots` (per-slot resident
KV, prefix matching, KV events), `scheduler` (continuous batching over
slots), `backend` (the llama.cpp model, context and calls), `runner` (the
engine thread), `tiers` (host and disk KV tiers for evicted prefixes),
`kvfile` (the disk tier's files), `transfer` (kv handles, held prefill KV, pieces), `files`
(tokenizer files for GetModelFiles) and `engine` (`LlamaCppEngine`).
Only `backend` imports llama_cpp, so everything else imports without it.
"""

from __future__ import annotations

from meshllm.engine.llamacpp.config import LlamaCppConfig
from meshllm.engine.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppConfig", "LlamaCppEngine"]
