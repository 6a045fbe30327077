"""Preprocessing: a validated TextRequest → prompt token ids → one TokenRequest per choice.

Chat messages go through the model's chat template (sandboxed Jinja, as
transformers renders it) and are tokenized without adding special tokens
(the template holds them); completion prompts are tokenized with them, or
taken as token ids. Long prompts are tokenized off the event loop. The
context length is checked here, and `max_tokens` settled: unset means "up to
the context length".
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from meshllm.errors import ContextLengthExceeded, InvalidArgument
from meshllm.frontend.models import ServedModel, Tokenization
from meshllm.frontend.text.tokenizer import encode_async
from meshllm.protocol.openai import TextRequest
from meshllm.protocol.types import OutputSettings, SamplingSettings, StopSettings, TokenRequest

__all__ = ["Plan", "Prompt", "preprocess"]

_RESERVED = frozenset({"messages", "add_generation_prompt", "tools"})


@dataclass(slots=True)
class Prompt:
    """One prompt of a request: its token ids and, for `echo`, its text."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Plan:
    """What to send upstream: choice `i` is `requests[i]`, for prompt `prompt_of[i]`."""

    prompts: list[Prompt]
    requests: list[TokenRequest]
    prompt_of: list[int]


async def _chat_prompt(req: TextRequest, model: ServedModel, tk: Tokenization, alone: bool) -> Prompt:
    if tk.template is None:
        raise InvalidArgument(
            f"model {model.name!r} has no chat template; use /v1/completions or serve it with one", param="messages"
        )
    # parse_chat keeps the reserved names out of template_kwargs; drop them anyway so that a
    # TextRequest built elsewhere cannot pass one twice (a TypeError, i.e. a 500).
    extra = {k: v for k, v in req.template_kwargs.items() if k not in _RESERVED}
    tools = list(req.tools) if req.tools else None
    text = tk.template.render(list(req.messages), add_generation_prompt=req.add_generation_prompt, tools=tools, **extra)
    if req.continue_final_message:
        text = _continued(text, str(req.messages[-1].get("content") or ""))
    return Prompt(await encode_async(tk.tokenizer, text, alone=alone), text)


def _continued(rendered: str, final: str) -> str:
    """`continue_final_message` (vLLM): the prompt ends right after the last message's content, unclosed."""
    cut = rendered.rfind(final) if final else -1
    if cut < 0:
        raise InvalidArgument(
            "continue_final_message: the chat template does not render the last message's content verbatim",
            param="continue_final_message",
        )
    return rendered[: cut + len(final)]


async def _completion_prompt(prompt: str | tuple[int, ...], tk: Tokenization, alone: bool) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(await encode_async(tk.tokenizer, prompt, add_special_tokens=True, alone=alone), prompt)
    vocab = tk.tokenizer.vocab_size
    if vocab and any(t >= vocab for t in prompt):
        bad = next(t for t in prompt if t >= vocab)
        raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
    return Prompt(list(prompt), tk.tokenizer.decode(prompt, skip_special_tokens=False))


def _max_tokens(req: TextRequest, prompt_len: int, context_length: int, param: str) -> int | None:
    if not context_length:
        return req.max_tokens
    if prompt_len >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has {prompt_len} tokens; "
            "please reduce the length of the prompt.",
            param=param,
        )
    if req.max_tokens is None:
        return context_length - prompt_len
    if prompt_len + req.max_tokens > context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, {req.max_tokens} for the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens",
        )
    return req.max_tokens


def _output_settings(req: TextRequest) -> OutputSettings:
    output = OutputSettings(skip_special_tokens=req.skip_special_tokens)
    if req.logprobs is not None:
        output["logprobs"] = req.logprobs
    if (k := req.prompt_logprobs_asked()) is not None:
        output["prompt_logprobs"] = k
    return output


def _sample_settings(req: TextRequest, j: int) -> SamplingSettings:
    """Choice `j`'s sampling: n samples, not n copies, so with n > 1 each choice gets its own seed."""
    if req.n == 1:
        return req.sampling
    sampling = SamplingSettings(**req.sampling)
    base = req.sampling.get("seed")
    sampling["seed"] = secrets.randbits(63) if base is None else (base + j) % (1 << 64)
    return sampling


async def preprocess(
    req: TextRequest,
    model: ServedModel,
    tk: Tokenization,
    request_id: str,
    *,
    alone: bool = False,
    annotations: dict[str, str] | None = None,
) -> Plan:
    """Render, tokenize, check lengths and build the upstream requests (choice i = prompt i // n, sample i % n).

    `alone`: this is the only request in flight (`encode_async` may then tokenize inline).
    `annotations` travel with every upstream request (the tenant, the client's request id).
    """
    if req.kind == "chat":
        prompts = [await _chat_prompt(req, model, tk, alone)]
        param = "messages"
    else:
        prompts = [await _completion_prompt(p, tk, alone) for p in req.prompts]
        param = "prompt"
    output = _output_settings(req)
    eos = list(tk.eos_token_ids)
    requests: list[TokenRequest] = []
    prompt_of: list[int] = []
    for p_index, prompt in enumerate(prompts):
        if not prompt.token_ids:
            raise InvalidArgument("the prompt is empty (no tokens)", param=param)
        stop = StopSettings(**req.stop_conditions)
        max_tokens = _max_tokens(req, len(prompt.token_ids), model.context_length, param)
        if max_tokens is not None:
            stop["max_tokens"] = max_tokens
        for j in range(req.n):
            sampling = _sample_settings(req, j)
            index = len(requests)
            requests.append(
                TokenRequest(
                    request_id=f"{request_id}-{index}",
                    model=model.name,
                    token_ids=prompt.token_ids,
                    sampling=sampling,
                    stop=stop,
                    output=output,
                    eos_token_ids=eos,
                )
            )
            if annotations:
                requests[-1]["annotations"] = annotations
            prompt_of.append(p_index)
    return Plan(prompts, requests, prompt_of)
