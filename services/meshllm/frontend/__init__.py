"""The frontend: OpenAI HTTP and text gRPC APIs, tokenization, chat templates and detokenization."""
