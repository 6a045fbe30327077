"""The OpenAI endpoints' semantics over the mesh: chat/completions, Responses, embeddings, tokenize, and the text gRPC API."""
