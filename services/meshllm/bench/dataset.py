"""`--dataset FILE`: requests from a ShareGPT-style file instead of random words.

One JSON object per line (JSONL), or one JSON array of them (the ShareGPT
download is an array). Each row is one of:

    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}   ShareGPT
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}   OpenAI chat
    {"prompt": "..."}                                                                          plain text

ShareGPT turns map to chat roles (human/user → user, gpt/chatgpt/assistant/
bing/bard → assistant, system → system). A conversation is sent up to its
last user turn; the assistant reply after it, when there is one, is the
reference output and sets the row's output length (its token count with the
tokenizer, else its characters / 4) as in `vllm bench serve`'s ShareGPT
dataset. A row may set the output length itself with `max_tokens` (or
`output_len`); rows without either use `--osl`. Rows are used in file order,
cycling when a run needs more than the file has.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from meshllm.bench.workload import BenchRequest, WorkloadSpec, make_request

if TYPE_CHECKING:
    from meshllm.bench.prompts import PromptBuilder

__all__ = ["DatasetRow", "dataset_request", "dataset_requests", "load_dataset"]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """One request of a dataset: the chat messages to send and its reference output (text or length)."""

    messages: tuple[dict[str, str], ...]
    reference: str | None = None  # the reply the dataset recorded, when it has one
    output_len: int | None = None  # set by the row (max_tokens / output_len)

    @property
    def prompt(self) -> str:
        """The messages as one text, for /v1/completions without a chat template."""
        return "\n\n".join(m["content"] for m in self.messages)


def _messages(raw: Any, key: str, where: str) -> tuple[tuple[dict[str, str], ...], str | None]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: {key!r} must be a non-empty list")
    out: list[dict[str, str]] = []
    for turn in raw:
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: every turn of {key!r} must be an object")
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        role = _ROLES.get(str(who).lower()) if who is not None else None
        if role is None or not isinstance(text, str):
            raise ValueError(f"{where}: a turn needs a known role (from/role: {who!r}) and a text (value/content)")
        out.append({"role": role, "content": text})
    reference = None
    while out and out[-1]["role"] == "assistant":
        reference = out.pop()["content"] if reference is None else reference
    if not any(m["role"] == "user" for m in out):
        raise ValueError(f"{where}: the conversation has no user turn")
    return tuple(out), reference


def _row(obj: Any, where: str) -> DatasetRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    output_len = obj.get("max_tokens", obj.get("output_len"))
    if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
        raise ValueError(f"{where}: max_tokens / output_len must be an integer >= 1")
    if "conversations" in obj:
        messages, reference = _messages(obj["conversations"], "conversations", where)
    elif "messages" in obj:
        messages, reference = _messages(obj["messages"], "messages", where)
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        messages, reference = ({"role": "user", "content": obj["prompt"]},), None
    else:
        raise ValueError(f"{where}: a row needs 'conversations', 'messages' or a non-empty 'prompt'")
    return DatasetRow(messages, reference, output_len)


def load_dataset(path: str | Path, limit: int | None = None) -> list[DatasetRow]:
    """The rows of a JSONL (or JSON array) dataset; ValueError naming file and line for a bad row."""
    path = Path(path)
    data = path.read_bytes()
    rows: list[DatasetRow] = []
    if data.lstrip().startswith(b"["):
        try:
            items = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path.name}: not valid JSON ({exc})") from None
        for i, obj in enumerate(items):
            rows.append(_row(obj, f"{path.name}: item {i}"))
            if limit is not None and len(rows) >= limit:
                break
    else:
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path.name}:{lineno}: not a JSON object ({exc})") from None
            rows.append(_row(obj, f"{path.name}:{lineno}"))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"--dataset {path}: no rows")
    return rows


def dataset_request(row: DatasetRow, spec: WorkloadSpec, builder: PromptBuilder | None) -> BenchRequest:
    """The request for one row, for `spec`'s model and API (see the module docstring for its output length)."""
    osl = row.output_len
    if osl is None and row.reference:
        osl = len(builder.tok.encode(row.reference)) if builder is not None else len(row.reference) // 4
    osl = max(osl or spec.osl, 1)
    if spec.api == "chat":
        messages = list(row.messages)
        isl = builder.count_messages(messages) if builder is not None else None
        return make_request(spec, osl, messages=messages, isl=isl)
    isl = builder.count(row.prompt) if builder is not None else None
    return make_request(spec, osl, prompt=row.prompt, isl=isl)


def dataset_requests(rows: Sequence[DatasetRow], spec: WorkloadSpec, builder: PromptBuilder | None) -> Iterator[BenchRequest]:
    """The rows' requests in order, cycling for ever (built one at a time: a large file costs only what is used)."""
    for i in itertools.count():
        yield dataset_request(rows[i % len(rows)], spec, builder)
