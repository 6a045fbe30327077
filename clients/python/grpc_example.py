"""Typed gRPC against meshllm: stream a chat through Inference, ask the Router why a worker was chosen.

    meshllm run --grpc-port 8001 --router-port 9000
    python clients/python/grpc_example.py --inference 127.0.0.1:8001 --router 127.0.0.1:9000

Uses the generated stubs shipped in the `meshllm` package (`meshllm.v1`,
built from protos/meshllm/v1/); a project of its own would generate them with
`python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. protos/meshllm/v1/*.proto`.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from meshllm.v1 import discovery_pb2, generate_pb2, inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc


def chat(inference: inference_pb2_grpc.InferenceStub, model: str, prompt: str, max_tokens: int, timeout_s: float) -> list[int]:
    """Stream one chat completion, printing text as it arrives; return the generated token ids."""
    request = inference_pb2.ChatRequest(
        model=model,
        messages=[inference_pb2.ChatMessage(role="user", content=prompt)],
        params=inference_pb2.TextParams(max_tokens=max_tokens),
    )
    token_ids: list[int] = []
    terminal = None
    print("text: ", end="", flush=True)
    for chunk in inference.ChatCompletion(request, timeout=timeout_s):
        print(chunk.text, end="", flush=True)
        token_ids.extend(chunk.token_ids)
        if chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            terminal = chunk
    print()
    if terminal is None:
        raise RuntimeError("the stream ended without a terminal chunk")
    if terminal.finish_reason == generate_pb2.FINISH_REASON_ERROR:
        raise RuntimeError(f"generation failed: {terminal.error.code}: {terminal.error.message}")
    reason = generate_pb2.FinishReason.Name(terminal.finish_reason)
    usage = terminal.usage
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
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each call, seconds")
    args = parser.parse_args()

    with grpc.insecure_channel(args.inference) as ich, grpc.insecure_channel(args.router) as rch:
        inference, router = inference_pb2_grpc.InferenceStub(ich), router_pb2_grpc.RouterStub(rch)
        try:
            model = args.model
            if not model:
                models = inference.ListModels(inference_pb2.ListModelsRequest(), timeout=args.timeout).models
                if not models:
                    raise RuntimeError(f"no model is served at {args.inference}")
                model = models[0].id
            print(f"model: {model}")
            generated = chat(inference, model, args.prompt, args.max_tokens, args.timeout)
            given = [int(t) for t in args.token_ids.split(",") if t.strip()]
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
