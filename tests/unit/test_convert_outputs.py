"""The wire format of chunks and requests: options, chunk fields, prompt logprobs and embeddings survive a proto round trip."""

from __future__ import annotations

from meshllm.protocol.convert import chunk_from_proto, chunk_to_proto, request_from_proto, request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2 as pb


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


def test_chunks_read_back_the_same_whatever_fields_they_set() -> None:
    """The plain token chunk's fast path and the general path agree (parsed off the wire, as a reader gets it)."""
    shapes: list[TokenChunk] = [
        {"token_ids": [7]},
        {"token_ids": [7, 8, 9]},
        {"token_ids": []},
        {"token_ids": [7], "index": 2},
        {"token_ids": [], "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}},
        {
            "token_ids": [7],
            "finish_reason": "stop",
            "stop_reason": "</s>",
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 2},
        },
        {"token_ids": [7], "logprobs": [{"token_id": 7, "logprob": -0.5, "top": [(7, -0.5)]}]},
        {"token_ids": [], "finish_reason": "error", "error": {"code": "Unavailable", "message": "gone"}},
    ]
    for chunk in shapes:
        wire = pb.GenerateChunk.FromString(chunk_to_proto(chunk).SerializeToString())
        assert chunk_from_proto(wire) == chunk, chunk
