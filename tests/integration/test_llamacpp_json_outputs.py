"""Guided JSON on the real SmolLM2 model: whatever finishes with `stop` parses, and validates against its schema.

A property test over generated schemas (nested objects, arrays with item
bounds, enums, consts, strings with patterns and lengths, integers and
numbers with bounds, anyOf, $ref): each is sent as `response_format`
json_schema through the `openai` SDK to `meshllm run --engine llamacpp`,
sampled at temperature 1 so the model wanders into every corner the grammar
allows. Every answer that finished with `stop` must `json.loads` and pass
`jsonschema.validate`; answers cut by `max_tokens` (finish `length`) are
prefixes and are not judged, but most must finish. JSON mode
(`json_object`) likewise: every finished answer parses to an object.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
from mesh_run import MeshRun
from openai import AsyncOpenAI
from test_llamacpp_support import require_model

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SCHEMAS = 32
CONCURRENCY = 4
MAX_TOKENS = 200
WORDS = ["alpha", "beta", "red", "blue", "café", 'say "hi"', "a\\b", "line\nbreak"]
PATTERNS = [r"^[A-Z]{2}-\d{3}$", r"^[a-z]+(\.[a-z]+)?$", r"^\d{4}-\d{2}-\d{2}$", r"^(yes|no|maybe)$", r"[^0-9]{1,8}"]


def gen_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One random schema; objects and arrays nest up to depth 2."""
    kinds = ["string", "pattern", "integer", "number", "boolean", "enum", "const", "null", "anyOf"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "tags", "score", "items", "ok", "note", "kind", "size"], rng.randint(1, 4))
        props = {n: gen_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": gen_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    if kind == "string":
        s: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.7:
            s["maxLength"] = rng.randint(1, 24)
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-300, 300)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = round(rng.uniform(-50, 50), 2)
        bound = "maximum" if rng.random() < 0.5 else "exclusiveMaximum"
        return {"type": "number", "minimum": lo, bound: round(lo + rng.uniform(1, 100), 2)}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 3, 4.5, None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "anyOf":
        return {"anyOf": [gen_schema(rng, 2), gen_schema(rng, 2)]}
    return {"type": kind}


def with_defs(rng: random.Random) -> dict[str, Any]:
    """A schema that reaches its parts through $ref."""
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer"}},
        "required": ["x", "y"],
    }
    return {
        "$defs": {"point": point},
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3},
            "label": {"type": "string", "maxLength": 12},
        },
        "required": ["points"],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[AsyncOpenAI]:
    with MeshRun.start(
        "--engine", "llamacpp", "--workers", "1", "--", "--n-ctx", "4096", "--n-seq-max", str(CONCURRENCY)
    ) as mesh:  # fmt: skip
        async with AsyncOpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            yield c


async def ask(client: AsyncOpenAI, gate: asyncio.Semaphore, response_format: dict[str, Any], seed: int) -> tuple[str, str]:
    async with gate:
        resp = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=[{"role": "user", "content": "Answer with one JSON value for a small inventory record."}],
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
    choice = resp.choices[0]
    return choice.message.content or "", choice.finish_reason


async def test_json_schema_outputs_parse_and_validate(client: AsyncOpenAI) -> None:
    rng = random.Random(20261127)
    schemas = [gen_schema(rng) for _ in range(SCHEMAS - 1)] + [with_defs(rng)]
    gate = asyncio.Semaphore(CONCURRENCY)
    formats = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}} for i, s in enumerate(schemas)]
    answers = await asyncio.gather(*(ask(client, gate, f, seed=i) for i, f in enumerate(formats)))
    stopped = 0
    for schema, (text, finish) in zip(schemas, answers, strict=True):
        if finish != "stop":
            continue
        stopped += 1
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            pytest.fail(f"output does not parse ({exc}): {text!r} for schema {json.dumps(schema)}")
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"output {text!r} does not validate ({exc.message}) against {json.dumps(schema)}")
    assert stopped >= SCHEMAS * 2 // 3, f"only {stopped} of {SCHEMAS} answers finished within {MAX_TOKENS} tokens"


async def test_json_mode_outputs_parse_to_objects(client: AsyncOpenAI) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)
    answers = await asyncio.gather(*(ask(client, gate, {"type": "json_object"}, seed=100 + i) for i in range(12)))
    finished = [text for text, finish in answers if finish == "stop"]
    assert len(finished) >= 6, answers
    for text in finished:
        assert isinstance(json.loads(text), dict), text
