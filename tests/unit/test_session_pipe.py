"""Merging in the two buffers of a Generate session (meshllm.plane.request.session), without a network.

The server's outbox (`_ServerSession.push`) merges a stream's tokens into its
chunk still waiting to be sent; the client's pipe (`_Pipe.put`) merges them
into the chunk its consumer has not taken yet. Both keep every token and
logprob in order, never merge across streams, and never merge a terminal.
"""

from __future__ import annotations

import pytest

from meshllm import errors
from meshllm.engine.base import terminal
from meshllm.plane.request.session import SessionServer, _ServerSession
from meshllm.plane.request.session_client import _Pipe
from meshllm.protocol import chunks
from meshllm.protocol.types import TokenChunk, TokenUsage

USAGE: TokenUsage = {"prompt_tokens": 1, "completion_tokens": 3, "cached_tokens": 0}


def tok(i: int, *, logprob: bool = False) -> TokenChunk:
    c: TokenChunk = {"token_ids": [i]}
    if logprob:
        c["logprobs"] = [{"token_id": i, "logprob": -float(i)}]
    return c


def outbox() -> _ServerSession:
    async def never(*_: object) -> None:  # the handler is not run by these tests
        raise AssertionError

    return _ServerSession(SessionServer(never, "/test"))  # type: ignore[arg-type]


def test_pipe_merges_untaken_tokens_with_their_logprobs_in_order() -> None:
    """Locks: non-terminal chunks the consumer has not taken become one chunk, tokens and logprobs concatenated."""
    pipe = _Pipe()
    for i in range(4):
        pipe.put(tok(i, logprob=True))
    assert list(pipe.queue) == [
        {"token_ids": [0, 1, 2, 3], "logprobs": [{"token_id": i, "logprob": -float(i)} for i in range(4)]}
    ]


def test_pipe_never_merges_a_terminal_nor_a_disagg_chunk() -> None:
    """Locks: the terminal (and a chunk carrying DisaggInfo) stays a chunk of its own."""
    pipe = _Pipe()
    pipe.put(tok(0))
    pipe.put({"token_ids": [1], "disagg": {"kv_handle": b"h"}})
    pipe.put(tok(2))
    pipe.put(terminal("eos", USAGE, token_ids=[3]))
    assert [c["token_ids"] for c in pipe.queue] == [[0], [1], [2], [3]]
    assert "finish_reason" in pipe.queue[-1]


def test_pipe_keeps_the_first_error() -> None:
    """Locks: a stream fails with the first error it was given (a later broken session does not replace it)."""
    pipe = _Pipe()
    pipe.fail(errors.NotFound("no such model"))
    pipe.fail(errors.Unavailable("session broke"))
    assert isinstance(pipe.error, errors.NotFound)


def test_outbox_merges_a_stream_into_its_pending_chunk_only() -> None:
    """Locks: a stream's later tokens join its own pending chunk, never another stream's; order per stream holds."""
    s = outbox()
    s.push(1, tok(10))
    s.push(2, tok(20))
    s.push(1, tok(11))
    s.push(2, tok(21))
    s.push(1, tok(12))
    assert s.items == [(1, {"token_ids": [10, 11, 12]}), (2, {"token_ids": [20, 21]})]


def test_outbox_puts_terminals_and_errors_after_the_pending_chunk() -> None:
    """Locks: a terminal or an error is its own item after the stream's pending tokens; usage of a merge is the newest."""
    s = outbox()
    s.push(1, {"token_ids": [1], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}})
    s.push(1, {"token_ids": [2], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}})
    s.push(1, terminal("length", USAGE))
    s.push(2, tok(5))
    err = errors.EngineShutdown("going away")
    s.push(2, err)
    s.push(3, err)
    assert [
        (sid, item.get("finish_reason", item.get("token_ids")) if isinstance(item, dict) else item) for sid, item in s.items
    ] == [
        (1, [1, 2]),
        (1, "length"),
        (2, [5]),
        (2, err),
        (3, err),
    ]
    first = s.items[0][1]
    assert isinstance(first, dict) and first["usage"]["completion_tokens"] == 2


def test_without_coalescing_neither_buffer_merges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: --no-coalesce (`set_coalescing(False)`): each chunk stays an item of its own in the outbox and in
    the pipe, so every engine step reaches the caller as its own chunk."""
    monkeypatch.setattr(chunks, "_coalescing", False)
    s = outbox()
    for i in range(3):
        s.push(1, tok(i))
    assert s.items == [(1, tok(0)), (1, tok(1)), (1, tok(2))]
    pipe = _Pipe()
    for i in range(3):
        pipe.put(tok(i, logprob=True))
    assert list(pipe.queue) == [tok(i, logprob=True) for i in range(3)]
    monkeypatch.setattr(chunks, "_coalescing", True)
    pipe.put(tok(3))
    assert list(pipe.queue)[-1]["token_ids"] == [2, 3]
