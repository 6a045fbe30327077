"""The wire format of prompt logprobs and embeddings: request options and chunk fields survive a proto round trip."""

from __future__ import annotations

from meshllm.protocol.convert import chunk_from_proto, chunk_to_proto, request_from_proto, request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest


def test_output_options_round_trip() -> None:
    req: TokenRequest = {
        "request_id": "r",
        "token_ids": [1, 2, 3],
        "output": {"logprobs": 0, "prompt_logprobs": 2, "skip_special_tokens": True, "embedding": True},
    }
    assert request_from_proto(request_to_proto(req))["output"] == req["output"]
    plain: TokenRequest = {"request_id": "r", "token_ids": [1], "output": {"skip_special_tokens": False}}
    assert request_from_proto(request_to_proto(plain))["output"] == {"skip_special_tokens": False}  # no embedding key


def test_prompt_logprobs_and_embedding_ride_on_chunks() -> None:
    chunk: TokenChunk = {
        "token_ids": [7],
        "prompt_logprobs": [
            {"token_id": 2, "logprob": -1.5, "top": [(2, -1.5), (9, -2.5)]},
            {"token_id": 3, "logprob": -0.5, "top": []},
        ],
        "embedding": [0.5, -0.25, 0.125],
    }
    back = chunk_from_proto(chunk_to_proto(chunk))
    assert back["prompt_logprobs"] == chunk["prompt_logprobs"] and back["embedding"] == chunk["embedding"]
    assert "prompt_logprobs" not in chunk_from_proto(chunk_to_proto({"token_ids": [1]}))
