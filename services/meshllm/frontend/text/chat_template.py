"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them.

Fidelity comes from copying transformers' Jinja environment (its
`_compile_jinja_template` / `render_jinja_template`):

* `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`) and a `generation`
  block tag that renders its body (transformers uses it to mark assistant text);
* `tojson` replaced by `json.dumps(x, ensure_ascii=False, indent=None,
  separators=None, sort_keys=False)` — Jinja's own escapes <, >, & and ';
* globals `raise_exception(message)` and `strftime_now(format)`;
* the same variables: `messages`, `tools`, `documents`, `add_generation_prompt`,
  the special tokens (`bos_token`, `eos_token`) and any extra keyword.

Jinja's default `keep_trailing_newline=False` is kept too: a template file's
final newline is not rendered, as in transformers.

Errors: a template that does not compile is a `ConfigError`; one that fails
while rendering (`raise_exception`, an undefined attribute used as a value, a
type error, a sandbox violation) is an `InvalidArgument` carrying the template's
message, which the frontend returns as a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "chat_template_for"]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API is a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled chat template; `render` is safe to call concurrently."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`, byte for byte what transformers would produce.

        `extra` reaches the template as variables (e.g. `documents`,
        `enable_thinking`, `pad_token`); it may override bos_token / eos_token,
        never `messages`, `tools` or `add_generation_prompt` (the arguments win).
        """
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None}
        variables.update(extra)
        variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(variables)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"chat template error: {exc.message or type(exc).__name__}", param="messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            raise InvalidArgument(f"chat template error: {type(exc).__name__}: {exc}", param="messages") from exc
        except RecursionError as exc:
            raise InvalidArgument("chat template error: recursion too deep", param="messages") from exc


def chat_template_for(tok: Tokenizer, *, override: str | None = None) -> ChatTemplate | None:
    """The chat template of tokenizer `tok` (or `override`), with its bos/eos texts; None when it has none."""
    source = override if override is not None else tok.chat_template
    if not source:
        return None
    return ChatTemplate(source, bos_token=tok.bos_token, eos_token=tok.eos_token)
