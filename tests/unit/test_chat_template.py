"""Chat templates render like transformers' apply_chat_template: same environment, helpers and errors."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument
from meshllm.frontend.text.chat_template import ChatTemplate, chat_template_for
from meshllm.frontend.text.tokenizer import Tokenizer

SYSTEM_USER: list[dict[str, Any]] = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Hi there"},
]


def test_trim_blocks_and_lstrip_blocks_remove_block_whitespace() -> None:
    """A block tag's own newline and indentation never reach the output (trim_blocks, lstrip_blocks)."""
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    assert ChatTemplate(source).render(SYSTEM_USER) == "[Hi there]\n"


def test_keep_trailing_newline_is_off_like_jinja_default() -> None:
    assert ChatTemplate("x\n").render([]) == "x"


def test_loop_controls_break_and_continue() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [*SYSTEM_USER, {"role": "user", "content": "never"}]
    assert ChatTemplate(source).render(messages) == "Hi there"


def test_add_generation_prompt_and_special_tokens_reach_the_template() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render(SYSTEM_USER) == "<s>You are brief.</s>Hi there</s>>"
    assert template.render(SYSTEM_USER, add_generation_prompt=False) == "<s>You are brief.</s>Hi there</s>"
    assert template.render([], bos_token="[B]") == "[B]>"


def test_raise_exception_becomes_invalid_argument_with_the_template_message() -> None:
    """A template's own validation (raise_exception) is a 400 carrying its text."""
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    with pytest.raises(InvalidArgument, match="Conversation must start with user") as info:
        ChatTemplate(source).render(SYSTEM_USER)
    assert not isinstance(info.value, ConfigError)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content + 1 }}",  # TypeError inside the sandbox
        "{{ messages[5]['content'] }}",  # an item of an undefined value
        "{{ ''.__class__.__mro__ }}",  # sandbox violation
        "{{ 1 / 0 }}",
    ],
)
def test_template_errors_while_rendering_are_invalid_argument(source: str) -> None:
    template = ChatTemplate(source)
    with pytest.raises(InvalidArgument, match="chat template error"):
        template.render(SYSTEM_USER)


def test_a_template_that_does_not_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_tojson_matches_transformers_not_jinja() -> None:
    """tojson is json.dumps(ensure_ascii=False): no HTML escaping, unicode kept, indent honoured."""
    tools = [{"name": "f", "description": "a < b & 'c' é", "parameters": {"type": "object"}}]
    assert ChatTemplate("{{ tools | tojson }}").render([], tools=tools) == json.dumps(tools, ensure_ascii=False)
    assert ChatTemplate("{{ tools[0] | tojson(indent=2) }}").render([], tools=tools) == json.dumps(
        tools[0], ensure_ascii=False, indent=2
    )


def test_tools_documents_and_extra_variables_are_defined() -> None:
    """Like transformers, `tools` and `documents` are always defined (None by default); extras pass through."""
    source = "{{ tools is none }} {{ documents is none }} {{ enable_thinking | default('unset') }}"
    assert ChatTemplate(source).render([]) == "True True unset"
    assert ChatTemplate(source).render([], tools=[{}], enable_thinking=False) == "False True False"


def test_strftime_now_and_generation_block() -> None:
    """strftime_now formats today's date; {% generation %} renders its body unchanged."""
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)}
    source = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render(SYSTEM_USER) == "<You are brief.><Hi there>"


def test_templates_cannot_mutate_messages() -> None:
    """The immutable sandbox refuses in-place changes to the caller's data."""
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidArgument):
        ChatTemplate("{{ messages.append({'role': 'x'}) }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_smollm2_template_renders_system_and_user_exactly(smollm2: Tokenizer) -> None:
    """The GGUF's template, read by hand: each message is <|im_start|>role\\ncontent<|im_end|>\\n."""
    template = chat_template_for(smollm2)
    assert template is not None
    assert template.render(SYSTEM_USER) == (
        "<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_template_adds_its_default_system_prompt(smollm2: Tokenizer) -> None:
    """Without a system message the template inserts SmolLM's own; no generation prompt when not asked."""
    template = chat_template_for(smollm2)
    assert template is not None
    assert template.render(SYSTEM_USER[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
    )


def test_smollm2_rendered_prompt_tokenizes_markers_as_single_special_ids(smollm2: Tokenizer) -> None:
    """Every <|im_start|> is id 1 and every <|im_end|> id 2 once the prompt is encoded."""
    template = chat_template_for(smollm2)
    assert template is not None
    ids = smollm2.encode(template.render(SYSTEM_USER))
    assert ids[:1] == [1] and ids.count(1) == 3 and ids.count(2) == 2
    assert ids[-4:] == [1, *smollm2.encode("assistant\n")]


def test_smollm2_template_with_content_none_is_invalid_argument(smollm2: Tokenizer) -> None:
    """SmolLM2's template concatenates content: None there is a clean 400, not a crash."""
    template = chat_template_for(smollm2)
    assert template is not None
    with pytest.raises(InvalidArgument, match="chat template error"):
        template.render([{"role": "user", "content": None}])
