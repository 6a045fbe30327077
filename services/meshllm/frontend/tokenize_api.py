"""GET /v1/models/{model}, and vLLM's POST /tokenize and /detokenize (also under /v1), over an InferenceCore.

    /tokenize    {"model", "prompt", "add_special_tokens"?: true}                       (completion form)
                 {"model", "messages", "add_generation_prompt"?, "continue_final_message"?,
                  "chat_template_kwargs"?, "tools"?}                                     (chat form: the chat template)
                 + "return_token_strs"?: false
              → {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model", "tokens"} → {"prompt"}

The chat form renders exactly what /v1/chat/completions would send the
engine (the same preprocessing, so a prompt over the context length is the
same 400). `token_strs` holds each token's own text (special tokens
included), where vLLM shows the tokenizer's raw pieces.
"""

from __future__ import annotations

from typing import Any

from meshllm.errors import InvalidArgument
from meshllm.frontend.inference import InferenceCore
from meshllm.frontend.preprocess import preprocess
from meshllm.frontend.tokenizer import encode_async
from meshllm.protocol.openai import model_object, parse_chat

__all__ = ["detokenize", "model_info", "tokenize"]

_CHAT_KEYS = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


def model_info(core: InferenceCore, name: str) -> dict[str, Any]:
    """The OpenAI model object of `name`; NotFound (404, param "model") when it is not served."""
    m = core.registry.lookup(name)
    return model_object(m.name, m.created, m.context_length)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidArgument("'model': a model name (non-empty string) is required", param="model")
    return body


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise InvalidArgument(f"'{key}': expected a boolean", param=key)
    return v


async def tokenize(core: InferenceCore, body: Any) -> dict[str, Any]:
    body = _object(body)
    model = core.registry.lookup(body["model"])
    tk = await core.registry.tokenization(model)
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        if "prompt" in body:
            raise InvalidArgument("give either 'prompt' or 'messages', not both", param="prompt")
        req = parse_chat({k: body[k] for k in _CHAT_KEYS if k in body})
        ids = (await preprocess(req, model, tk, "tokenize")).prompts[0].token_ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidArgument("'prompt': expected a string (or give 'messages')", param="prompt")
        ids = await encode_async(tk.tokenizer, prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    dec = tk.tokenizer.decode
    return {
        "count": len(ids),
        "max_model_len": model.context_length,
        "tokens": ids,
        "token_strs": [dec([t], skip_special_tokens=False) for t in ids] if strs else None,
    }


async def detokenize(core: InferenceCore, body: Any) -> dict[str, Any]:
    body = _object(body)
    model = core.registry.lookup(body["model"])
    tk = await core.registry.tokenization(model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidArgument("'tokens': expected an array of non-negative token ids", param="tokens")
    vocab = tk.tokenizer.vocab_size
    if vocab and (bad := next((t for t in ids if t >= vocab), None)) is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": tk.tokenizer.decode(ids, skip_special_tokens=False)}
