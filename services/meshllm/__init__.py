"""meshllm: a gRPC microservice mesh that serves large language models."""

__version__ = "0.1.0"

__all__ = ["__version__"]
