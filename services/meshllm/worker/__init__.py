"""The worker: one engine behind the Worker gRPC service (`meshllm worker`)."""
