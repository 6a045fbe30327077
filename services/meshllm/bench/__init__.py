"""`meshllm bench`: load generation against any OpenAI-compatible endpoint (lean HTTP client, seeded workloads)."""
