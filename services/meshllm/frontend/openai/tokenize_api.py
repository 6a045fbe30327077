"""GET /v1/models/{model}, and vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (also under /v1).

    /tokenize    {"model"?, "prompt", "add_special_tokens"?: true}                      (completion form)
                 {"model"?, "messages", "add_generation_prompt"?, "continue_final_message"?,
                  "chat_template_kwargs"?, "tools"?}                                     (chat form: the chat template)
                 + "return_token_strs"?: false
              → {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model"?, "tokens"} → {"prompt"}
    /tokenizer_info[?model=NAME]
              → {"model", "tokenizer_class", "bos_token", "eos_token", "pad_token", "chat_template", "model_max_length"}

As in vLLM, "model" may be left out: it then names the one model the mesh
serves (a 400 naming them when it serves several). lm-evaluation-harness's
`remote` tokenizer backend (the one its `local-completions` model picks by
itself when /tokenizer_info and /tokenize answer) sends no model.

The chat form renders exactly what /v1/chat/completions would send the
engine (the same preprocessing, so a prompt over the context length is the
same 400). `token_strs` holds each token's own text (special tokens
included), where vLLM shows the tokenizer's raw pieces. /tokenizer_info's
tokens are strings, null where the tokenizer has none (no tokenizer here
names a pad token); `tokenizer_class` is meshllm's class, not Hugging Face's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshllm.errors import InvalidArgument, Unavailable
from meshllm.frontend.openai.inference import InferenceCore
from meshllm.frontend.text.preprocess import preprocess
from meshllm.frontend.text.tokenizer import encode_async
from meshllm.protocol.openai import model_object, parse_chat

if TYPE_CHECKING:
    from meshllm.frontend.models import ServedModel

__all__ = ["detokenize", "model_info", "tokenize", "tokenizer_info"]

_CHAT_KEYS = ("model", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


def model_info(core: InferenceCore, name: str) -> dict[str, Any]:
    """The OpenAI model object of `name`; NotFound (404, param "model") when it is not served."""
    m = core.registry.lookup(name)
    return model_object(m.name, m.created, m.context_length)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    return body


def served_model(core: InferenceCore, name: Any) -> ServedModel:
    """The model `name` names; None (left out) names the only model served.

    NotFound for an unknown name, InvalidArgument for a name that is not a
    non-empty string or a left-out name when several models are served,
    Unavailable when none is served yet.
    """
    if name is None:
        models = core.registry.list()
        if len(models) == 1:
            return models[0]
        if not models:
            raise Unavailable("no model is served yet")
        names = ", ".join(m.name for m in models)
        raise InvalidArgument(f"'model' is required: this mesh serves several models ({names})", param="model")
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgument("'model': a model name (non-empty string) is required", param="model")
    return core.registry.lookup(name)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise InvalidArgument(f"'{key}': expected a boolean", param=key)
    return v


async def tokenize(core: InferenceCore, body: Any) -> dict[str, Any]:
    body = _object(body)
    model = served_model(core, body.get("model"))
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
    model = served_model(core, body.get("model"))
    tk = await core.registry.tokenization(model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidArgument("'tokens': expected an array of non-negative token ids", param="tokens")
    vocab = tk.tokenizer.vocab_size
    if vocab and (bad := next((t for t in ids if t >= vocab), None)) is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": tk.tokenizer.decode(ids, skip_special_tokens=False)}


async def tokenizer_info(core: InferenceCore, name: str | None) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info for model `name` (None: the only one served)."""
    model = served_model(core, name)
    tk = await core.registry.tokenization(model)
    tok = tk.tokenizer
    return {
        "model": model.name,
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token or None,
        "eos_token": tok.eos_token or None,
        "pad_token": None,
        "chat_template": tk.template.source if tk.template is not None else None,
        "model_max_length": model.context_length,
    }
