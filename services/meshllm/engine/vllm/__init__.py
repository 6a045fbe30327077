"""The `vllm` engine: vLLM's AsyncLLM behind the LLMEngine contract (engine.py), its KV events (kv_events.py)."""
