"""Typed gRPC against meshllm: stream a chat through Inference, ask the Router why a worker was chosen.

    meshllm run --grpc-port 8001 --router-port 9000
    python clients/python/grpc_example.py --inference 127.0.0.1:8001 --router 127.0.0.1:9000

With `--weather-tool` the chat offers a `get_weather(city)` function
(`--tool-choice auto|required|none|get_weather`); the tool calls the model
makes stream as pieces and are printed whole at the end, reasoning (when the
frontend runs a reasoning parser) as it comes. `--prompt-logprobs N` prints
the prompt's log-likelihood (engines that compute it: llamacpp). `--router ""`
skips the Router calls.

Uses the generated stubs shipped in the `meshllm` package (`meshllm.v1`,
built from protos/meshllm/v1/); a project of its own would generate them with
`python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. protos/meshllm/v1/*.proto`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from meshllm.v1 import discovery_pb2, generate_pb2, inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc

WEATHER = inference_pb2.Tool(
    name="get_weather",
    description="The current weather in a city.",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
MODES = {
    "auto": inference_pb2.ToolChoice.MODE_AUTO,
    "none": inference_pb2.ToolChoice.MODE_NONE,
    "required": inference_pb2.ToolChoice.MODE_REQUIRED,
}


def chat_request(model: str, prompt: str, args: argparse.Namespace) -> inference_pb2.ChatRequest:
    """The ChatRequest the flags ask for."""
    request = inference_pb2.ChatRequest(
        model=model,
        messages=[inference_pb2.ChatMessage(role="user", content=prompt)],
        params=inference_pb2.TextParams(max_tokens=args.max_tokens),
    )
    if args.prompt_logprobs is not None:
        request.params.prompt_logprobs = args.prompt_logprobs
    if args.weather_tool:
        request.tools.append(WEATHER)
        if args.tool_choice in MODES:
            request.tool_choice.mode = MODES[args.tool_choice]
        else:  # a function name: call exactly it
            request.tool_choice.function = args.tool_choice
    return request


def chat(inference: inference_pb2_grpc.InferenceStub, request: inference_pb2.ChatRequest, timeout_s: float) -> list[int]:
    """Stream one chat completion, printing text as it arrives; return the generated token ids."""
    token_ids: list[int] = []
    calls: dict[int, dict[str, str]] = {}  # tool calls by index, their pieces put together
    terminal = None
    part = ""  # what is being printed now: "reasoning" or "text"
    for chunk in inference.ChatCompletion(request, timeout=timeout_s):
        if chunk.prompt_logprobs:  # the first chunk; the first prompt token has no logprob
            total = sum(e.logprob for e in chunk.prompt_logprobs if e.HasField("logprob"))
            print(f"prompt_logprob_sum: {total:.4f} over {len(chunk.prompt_logprobs)} tokens")
        for name, piece in (("reasoning", chunk.reasoning), ("text", chunk.text)):
            if piece:
                if part != name:
                    print(f"{chr(10) if part else ''}{name}: ", end="")
                    part = name
                print(piece, end="", flush=True)
        for piece in chunk.tool_calls:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] = piece.name or call["name"]
            call["arguments"] += piece.arguments
        token_ids.extend(chunk.token_ids)
        if chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            terminal = chunk
    print()
    for i in sorted(calls):
        print(f"tool_call: {calls[i]['name']} {calls[i]['arguments']} id={calls[i]['id']}")
    if terminal is None:
        raise RuntimeError("the stream ended without a terminal chunk")
    if terminal.finish_reason == generate_pb2.FINISH_REASON_ERROR:
        raise RuntimeError(f"generation failed: {terminal.error.code}: {terminal.error.message}")
    reason = generate_pb2.FinishReason.Name(terminal.finish_reason)
    usage = terminal.usage
    if terminal.tool_calls_finished:
        reason += " (tool_calls)"
    print(f"finish_reason: {reason} prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}")
    return token_ids


def route(router: router_pb2_grpc.RouterStub, model: str, token_ids: list[int], timeout_s: float) -> None:
    """Print the Router's decision for a prompt of `token_ids`, with every candidate's score, then its workers."""
    decision = router.Route(router_pb2.RouteRequest(model=model, token_ids=token_ids), timeout=timeout_s)
    role = discovery_pb2.WorkerRole.Name(decision.role)
    print(
        f"route: worker_id={decision.worker_id} address={decision.address} role={role} "
        f"policy={decision.policy} prompt_blocks={decision.prompt_blocks}"
    )
    for c in decision.candidates:
        print(
            f"  candidate {c.worker_id} overlap_blocks={c.overlap_blocks} prefill_tokens={c.prefill_tokens} "
            f"decode_blocks={c.decode_blocks} cost={c.cost:g}"
        )
    for w in router.ListWorkers(router_pb2.ListWorkersRequest(model=model), timeout=timeout_s).workers:
        print(
            f"worker: {w.worker_id} {discovery_pb2.WorkerRole.Name(w.role)} {w.address} "
            f"active_blocks={w.active_blocks}/{w.total_blocks} in_flight={w.in_flight}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inference", default=os.environ.get("MESHLLM_INFERENCE_ADDRESS", "127.0.0.1:8001"))
    parser.add_argument("--router", default=os.environ.get("MESHLLM_ROUTER_ADDRESS", "127.0.0.1:9000"))
    parser.add_argument("--model", default="", help="model name (default: the first one ListModels returns)")
    parser.add_argument("--prompt", default="Write a haiku about a mesh of small services.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--token-ids", default="", help="comma-separated prompt token ids to route (default: the ids the chat produced)"
    )
    parser.add_argument("--weather-tool", action="store_true", help="offer a get_weather(city) function")
    parser.add_argument("--tool-choice", default="auto", help="auto, none, required, or a function name to force")
    parser.add_argument(
        "--prompt-logprobs", type=int, default=None, help="print the prompt's log-likelihood (alternatives per token)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each call, seconds")
    args = parser.parse_args()

    with grpc.insecure_channel(args.inference) as ich, grpc.insecure_channel(args.router or args.inference) as rch:
        inference, router = inference_pb2_grpc.InferenceStub(ich), router_pb2_grpc.RouterStub(rch)
        try:
            model = args.model
            if not model:
                models = inference.ListModels(inference_pb2.ListModelsRequest(), timeout=args.timeout).models
                if not models:
                    raise RuntimeError(f"no model is served at {args.inference}")
                model = models[0].id
            print(f"model: {model}")
            generated = chat(inference, chat_request(model, args.prompt, args), args.timeout)
            given = [int(t) for t in args.token_ids.split(",") if t.strip()]
            if args.router:
                route(router, model, given or generated, args.timeout)
        except grpc.RpcError as exc:
            print(f"\ngrpc_example: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
        except RuntimeError as exc:
            print(f"\ngrpc_example: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
