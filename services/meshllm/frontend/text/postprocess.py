"""Postprocessing of one choice: token chunks → text deltas, stop strings, finish reason, usage.

Per choice, a `ChoiceStream` detokenizes incrementally (multi-byte UTF-8 split
across tokens is held until complete), runs the stop-string matcher (a
possible partial match is held back until resolved, a match is never
emitted), splits reasoning and tool calls out of the text when the request
asks for them (`meshllm.frontend.text.output_parsers`; "stop" becomes
"tool_calls" once a call was parsed) and maps the finish reason. A matched stop string finishes the
choice: the caller then drops the upstream stream, which cancels the request
on the worker. A terminal "error" chunk is raised as its MeshError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshllm.errors import InvalidArgument, Unavailable, error_from_code
from meshllm.frontend.models import Tokenization
from meshllm.frontend.text.detokenize import IncrementalDetokenizer
from meshllm.frontend.text.output_parsers import OutputParser
from meshllm.frontend.text.stop_strings import StopStringMatcher
from meshllm.frontend.tools import CallDelta
from meshllm.protocol.openai import LogprobEntry, finish_reason_openai
from meshllm.protocol.types import TokenChunk

__all__ = ["ChoiceStream", "Delta"]


@dataclass(slots=True)
class Delta:
    """New output of one choice: text (maybe empty), logprobs when asked, finish reason on the last one."""

    index: int
    text: str
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    offset: int = 0  # characters of this choice's text before `text` (completion logprobs' text_offset)
    token_ids: list[int] | None = None  # the upstream chunk's token ids behind `text`
    prompt_logprobs: list[LogprobEntry] | None = None  # first delta only, when asked: every prompt token's
    reasoning: str = ""  # reasoning_content split out of the text (a reasoning parser is on)
    tool_calls: list[CallDelta] | None = None  # tool-call pieces parsed out of the text


class ChoiceStream:
    """Turns one choice's GenerateChunks into Deltas (see the module docstring)."""

    __slots__ = (
        "_cached",
        "_detok",
        "_logprobs",
        "_matcher",
        "_prompt_first",
        "_prompt_logprobs",
        "_tok",
        "completion_tokens",
        "finish_reason",
        "index",
        "output",
        "prompt_index",
        "prompt_tokens",
        "text_offset",
    )

    def __init__(
        self,
        index: int,
        tk: Tokenization,
        prompt_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        prompt_index: int = 0,
        output: OutputParser | None = None,
    ) -> None:
        self.index = index
        self.output = output
        self.prompt_index = prompt_index
        self._tok = tk.tokenizer
        self._detok = IncrementalDetokenizer(tk.tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        self._matcher = StopStringMatcher(stop) if stop else None
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._prompt_first = prompt_ids[0] if prompt_ids else -1
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self._cached = 0
        self.finish_reason: str | None = None
        self.text_offset = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_tokens(self) -> int:
        return self._cached

    # size: runs once per chunk: detokenize, stop strings, logprobs and finish inline (a call per step costs on every token)
    def feed(self, chunk: TokenChunk) -> Delta:
        """Process one upstream chunk; the Delta's finish_reason is set when the choice is done."""
        ids = chunk.get("token_ids")
        reason = chunk.get("finish_reason")
        asked = self._prompt_logprobs and reason not in ("error", "cancelled")  # those raise their own error below
        prompt_entries = self._prompt_entries(chunk) if asked else None
        usage = chunk.get("usage")
        if usage is not None:
            self._cached = usage["cached_tokens"]
        text = ""
        if ids:
            self.completion_tokens += len(ids)
            text = self._detok.push(ids)
        if reason is not None:
            if reason == "error":
                err = chunk.get("error") or {"code": "Unknown", "message": "upstream error"}
                raise error_from_code(err["code"], err["message"])
            if reason == "cancelled":
                raise Unavailable("the request was cancelled upstream (a worker stopped)")
            text += self._detok.flush()
            if usage is not None and usage["completion_tokens"]:
                self.completion_tokens = usage["completion_tokens"]
        finish: str | None = None
        if self._matcher is not None:
            emit, stopped = self._matcher.push(text) if text else ("", False)
            if stopped:
                finish = "stop"
            elif reason is not None:
                emit += self._matcher.flush()
            text = emit
        if finish is None and reason is not None:
            finish = finish_reason_openai(reason)
        reasoning, calls = "", None
        if self.output is not None:
            parsed = self.output.feed(text) if text else None
            if finish is not None:
                tail = self.output.finish()
                if parsed is not None:
                    tail.content, tail.reasoning = parsed.content + tail.content, parsed.reasoning + tail.reasoning
                    tail.calls[:0] = parsed.calls
                parsed = tail
                if finish == "stop" and self.output.called:
                    finish = "tool_calls"
            if parsed is not None:
                text, reasoning, calls = parsed.content, parsed.reasoning, parsed.calls or None
            else:
                text = ""
        self.finish_reason = finish
        entries = self._entries(chunk) if self._logprobs else None
        offset = self.text_offset
        self.text_offset += len(text)
        return Delta(self.index, text, entries, finish, offset, ids, prompt_entries, reasoning, calls)

    def _entries(self, chunk: TokenChunk, key: Literal["logprobs", "prompt_logprobs"] = "logprobs") -> list[LogprobEntry]:
        dec = self._tok.decode
        out = []
        for lp in chunk.get(key, ()):
            top = lp.get("top", ())
            texts = [(dec([t], skip_special_tokens=False), p) for t, p in top]
            token = dec([lp["token_id"]], skip_special_tokens=False)
            out.append(LogprobEntry(token, lp["logprob"], texts, lp["token_id"], [t for t, _ in top]))
        return out

    def _prompt_entries(self, chunk: TokenChunk) -> list[LogprobEntry]:
        """The first chunk's prompt logprobs, after an entry without one for the first prompt token (once).

        An engine that ignored `output.prompt_logprobs` (one that predates it) is refused here, before the
        response starts, rather than answered without them.
        """
        self._prompt_logprobs = False
        if "prompt_logprobs" not in chunk and self._prompt_first >= 0 and self.prompt_tokens > 1:
            raise InvalidArgument(
                "the engine serving this model does not compute prompt logprobs "
                "(asked for by 'prompt_logprobs', or by 'echo' with 'logprobs')",
                param="prompt_logprobs",
            )
        first = LogprobEntry(self._tok.decode([self._prompt_first], skip_special_tokens=False), None, (), self._prompt_first)
        return [first, *self._entries(chunk, "prompt_logprobs")]
