"""The built-in byte tokenizer for the `mocker` and `sample` engines: no files, exact round trips.

Id layout (the same for every built-in name):

    0            <pad>
    1            <s>   bos
    2            </s>  eos
    3 .. 258     the 256 byte values: id = byte + 3, so any text encodes exactly
    259 ..       deterministic pseudo-words with a leading space (" kalo", " renmi,"),
                 so the random ids a mocker emits read like text

Encoding never produces ids >= 259: text always becomes its UTF-8 bytes. The chat
template markers (`<|im_start|>`, `<|im_end|>`) are therefore ordinary bytes too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from meshllm.config import ConfigError
from meshllm.errors import InvalidArgument

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "BUILTIN_NAMES",
    "BYTE_OFFSET",
    "FIRST_WORD_ID",
    "BuiltinTokenizer",
    "builtin_tokenizer",
    "pseudo_word",
]

BUILTIN_NAMES = ("mocker", "sample")
BYTE_OFFSET = 3
FIRST_WORD_ID = BYTE_OFFSET + 256
DEFAULT_VOCAB_SIZE = 32000

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}

# ChatML, like most instruct models; content may be a string, a list of text parts or absent.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SYLLABLES = (
    "ka", "lo", "mi", "ren", "to", "sa", "vel", "du", "ni", "ar", "be", "cor", "da", "el", "fi", "gan",
    "ho", "is", "jo", "ku", "la", "mo", "na", "or", "pe", "qui", "ra", "si", "tu", "ul", "va", "wen",
    "xa", "yo", "zu", "an", "en", "in", "on", "un", "ter", "sol", "mar", "ith", "ven", "por", "les", "dor",
)  # fmt: skip


def _mix(x: int) -> int:
    """A 32-bit integer hash (lowbias32): stable across runs, unlike `hash()`."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def pseudo_word(token_id: int) -> str:
    """The text of a word id (>= 259): a space, one to three syllables, sometimes a comma or full stop."""
    h = _mix(token_id)
    count = (1, 2, 2, 3)[h & 3]
    h >>= 2
    syllables = []
    for _ in range(count):
        syllables.append(_SYLLABLES[h % len(_SYLLABLES)])
        h //= len(_SYLLABLES)
    tail = _mix(token_id ^ 0x5BD1E995) % 16
    return " " + "".join(syllables) + ("," if tail == 0 else "." if tail == 1 else "")


@functools.lru_cache(maxsize=4)
def _pieces(vocab_size: int) -> tuple[bytes, ...]:
    """The bytes of every id below `vocab_size`, built once per size (~30 ms for 32000)."""
    specials = [_SPECIAL_TEXT[i].encode() for i in range(BYTE_OFFSET)]
    single_bytes = [bytes([b]) for b in range(256)]
    return (*specials, *single_bytes, *(pseudo_word(i).encode() for i in range(FIRST_WORD_ID, vocab_size)))


class BuiltinTokenizer:
    """Byte-exact tokenizer with pseudo-word ids above the bytes; see the module docstring."""

    def __init__(self, name: str = "mocker", *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size < FIRST_WORD_ID:
            raise ConfigError(f"builtin tokenizer needs vocab_size >= {FIRST_WORD_ID}, got {vocab_size}")
        self.name = f"builtin:{name}"
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = BOS_ID
        self.eos_token_ids: tuple[int, ...] = (EOS_ID,)
        self.bos_token = _SPECIAL_TEXT[BOS_ID]
        self.eos_token = _SPECIAL_TEXT[EOS_ID]
        self.chat_template: str | None = BUILTIN_CHAT_TEMPLATE
        self._pieces = _pieces(vocab_size)

    def __repr__(self) -> str:
        return f"BuiltinTokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        ids.extend(b + BYTE_OFFSET for b in text.encode("utf-8", errors="surrogatepass"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return b"".join(self._piece(i, skip_special_tokens) for i in ids).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < BYTE_OFFSET

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (special ids as their text)."""
        return self._piece(token_id, False)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if token_id < BYTE_OFFSET:
            if token_id < 0:
                raise InvalidArgument(f"token id {token_id} is negative", param="token_ids")
            return b"" if skip_special else self._pieces[token_id]
        if token_id < self.vocab_size:
            return self._pieces[token_id]
        return pseudo_word(token_id).encode()  # beyond the vocab: still deterministic, never a crash


def builtin_tokenizer(name: str = "mocker", *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> BuiltinTokenizer:
    """The built-in tokenizer `builtin:NAME` (NAME in BUILTIN_NAMES); no files needed."""
    if name not in BUILTIN_NAMES:
        raise ConfigError(f"unknown builtin tokenizer {name!r} (known: {', '.join(BUILTIN_NAMES)})")
    return BuiltinTokenizer(name, vocab_size=vocab_size)
