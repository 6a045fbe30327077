"""Check a running Dynamo + vLLM OpenAI endpoint (stdlib only; run with any python3).

Usage: python3 dynamo_vllm_check.py [BASE_URL]   (default http://127.0.0.1:18090)
Checks /v1/models, a chat completion, a streamed chat (stream_options.include_usage), and three requests sharing a
~440-token system prompt: usage.prompt_tokens_details.cached_tokens > 0 shows vLLM prefix caching (with --router-mode
kv, every repeat lands on the worker that holds the prefix).
"""

import json
import sys
import time
import urllib.request
from typing import Any

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18090"


def get(path: str) -> Any:
    with urllib.request.urlopen(BASE + path, timeout=30) as r:
        return json.load(r)


def post(body: dict[str, Any], stream: bool = False) -> Any:
    req = urllib.request.Request(BASE + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.load(r)
        lines = (x.decode().strip() for x in r)
        return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]


def main() -> int:
    models = get("/v1/models")
    model = models["data"][0]["id"]
    print("models:", [m["id"] for m in models["data"]])
    msgs = [
        {"role": "system", "content": "Answer the question in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    t = time.time()
    r = post({"model": model, "messages": msgs, "max_tokens": 32, "temperature": 0})
    print(f"chat ({time.time() - t:.2f}s):", repr(r["choices"][0]["message"]["content"]), r["usage"])
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = time.time()
    chunks = post(body, stream=True)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    print(f"stream ({time.time() - t:.2f}s): {len(chunks)} chunks", repr(text), "usage:", chunks[-1].get("usage"))
    # A fresh nonce first, so the first request of this run cannot hit a cache left by an earlier run.
    facts = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 27))
    sysmsg = f"Session {time.time_ns()}. You are a careful assistant. {facts}"
    cached = []
    for q, stream in (("What is 7 squared?", False), ("What is 9 squared?", False), ("What is 12 squared?", True)):
        body = {
            "model": model,
            "messages": [{"role": "system", "content": sysmsg}, {"role": "user", "content": q}],
            "max_tokens": 16,
            "temperature": 0,
        }
        t = time.time()
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            u = post(body, True)[-1]["usage"]
        else:
            u = post(body)["usage"]
        cached.append((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        print(
            f"prefix {'stream' if stream else 'plain '} ({time.time() - t:.2f}s): "
            f"prompt_tokens={u['prompt_tokens']} cached_tokens={cached[-1]}"
        )
    ok = "Paris" in text and max(cached[1:]) > 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
