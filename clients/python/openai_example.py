"""Stream a chat completion from meshllm with the official OpenAI Python SDK.

    meshllm run                     # prints "OpenAI HTTP API    http://127.0.0.1:8000/v1"
    python clients/python/openai_example.py --base-url http://127.0.0.1:8000/v1

Any OpenAI client works unchanged: point its base URL at the frontend. meshllm
does not check API keys; the SDK insists on one, so any string will do.
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import APIError, OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("MESHLLM_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--model", default="", help="model name (default: the first one /v1/models lists)")
    parser.add_argument("--prompt", default="Write a haiku about a mesh of small services.")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "meshllm"), timeout=60.0)
    try:
        return chat(client, args)
    except APIError as exc:  # connection errors, 4xx and 5xx alike: one line, exit 1
        print(f"\nopenai_example: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def chat(client: OpenAI, args: argparse.Namespace) -> int:
    model = args.model or client.models.list().data[0].id
    print(f"model: {model}")

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    print("text: ", end="", flush=True)
    finish_reason, usage = None, None
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
            finish_reason = choice.finish_reason or finish_reason
        usage = chunk.usage or usage
    print()
    print(f"finish_reason: {finish_reason}", end="")
    if usage is not None:
        print(f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
