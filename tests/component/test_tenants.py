"""Tenants stay apart (issue 36): one in-process frontend with two API keys (two teams), echo workers on memory
planes, real HTTP on loopback.

- A stored response is its tenant's: another key's GET, DELETE or
  `previous_response_id` gets exactly the 404 of an id that never existed.
- Nothing that works as a handle is shown: /dashboard, /dashboard/state and
  /metrics need a key (Bearer, or Basic with the key as password for a
  browser's prompt) unless `--open-metrics`, and the dashboard names
  requests by digest, never by id.
- Client-chosen request ids are only names: two tenants sending the same
  `x-request-id` / body `request_id` at once both complete, each sees its
  own id echoed, the worker saw two distinct mesh ids, and the router's
  load returns to zero.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import orjson
import pytest
import pytest_asyncio
from frontend_support import Mesh, start_mesh

from meshllm.frontend.http.app import OpenAIApp
from meshllm.frontend.http.auth import ApiKeys
from meshllm.frontend.http.dashboard import ASSETS, Dashboard
from meshllm.frontend.http.server import HttpServer
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEAM_A = "sk-team-a-0123456789abcdef"
TEAM_B = "sk-team-b-fedcba9876543210"
KEYS = ApiKeys.parse([f"team-a:{TEAM_A}", f"team-b:{TEAM_B}"], source="test")


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=2, api_keys=KEYS)
    yield m
    await m.aclose()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http(mesh: Mesh) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=mesh.url, timeout=30) as c:
        yield c


async def create_response(http: httpx2.AsyncClient, key: str, text: str, **extra: Any) -> httpx2.Response:
    body = {"model": "echo", "input": f"ECHO:{text}", "max_output_tokens": 16, **extra}
    return await http.post("/v1/responses", json=body, headers=auth(key))


async def test_a_stored_response_is_invisible_to_another_tenant(http: httpx2.AsyncClient) -> None:
    made = await create_response(http, TEAM_A, "secret plan")
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    never = "resp_" + "0" * 32 + "-0"

    own = await http.get(f"/v1/responses/{rid}", headers=auth(TEAM_A))
    assert own.status_code == 200 and own.json()["id"] == rid and own.json()["output"] == made.json()["output"]

    def same_as_unknown(foreign: httpx2.Response, unknown: httpx2.Response) -> None:
        assert foreign.status_code == unknown.status_code == 404
        assert foreign.json() == orjson.loads(unknown.content.replace(never.encode(), rid.encode()))

    for method in ("GET", "DELETE"):
        foreign = await http.request(method, f"/v1/responses/{rid}", headers=auth(TEAM_B))
        unknown = await http.request(method, f"/v1/responses/{never}", headers=auth(TEAM_B))
        same_as_unknown(foreign, unknown)
    foreign = await create_response(http, TEAM_B, "more", previous_response_id=rid)
    unknown = await create_response(http, TEAM_B, "more", previous_response_id=never)
    same_as_unknown(foreign, unknown)

    # Still there for its owner (nothing the other tenant did touched it); the owner continues, then deletes it.
    follow = await create_response(http, TEAM_A, "next", previous_response_id=rid)
    assert follow.status_code == 200, follow.text
    gone = await http.delete(f"/v1/responses/{rid}", headers=auth(TEAM_A))
    assert gone.status_code == 200 and gone.json() == {"id": rid, "object": "response", "deleted": True}
    assert (await http.get(f"/v1/responses/{rid}", headers=auth(TEAM_A))).status_code == 404


async def test_an_unauthenticated_caller_cannot_read_a_response_either(http: httpx2.AsyncClient) -> None:
    rid = (await create_response(http, TEAM_A, "x")).json()["id"]
    assert (await http.get(f"/v1/responses/{rid}")).status_code == 401


async def test_monitoring_routes_need_a_key_and_take_basic_for_browsers(mesh: Mesh, http: httpx2.AsyncClient) -> None:
    basic = "Basic " + base64.b64encode(f"anyone:{TEAM_B}".encode()).decode()
    for path in ("/metrics", "/dashboard", "/dashboard/state", *ASSETS):
        refused = await http.get(path)
        assert refused.status_code == 401, path
        expected = "Basic" if path in ASSETS else "Bearer"
        assert refused.headers["www-authenticate"].startswith(expected), (path, refused.headers)
        assert (await http.get(path, headers=auth(TEAM_A))).status_code == 200, path
        assert (await http.get(path, headers={"authorization": basic})).status_code == 200, path
    # Basic is for the monitoring routes only: the API itself wants Bearer.
    assert (await http.get("/v1/models", headers={"authorization": basic})).status_code == 401


async def test_open_metrics_opens_exactly_the_monitoring_routes(mesh: Mesh) -> None:
    assert mesh.frontend.router is not None
    dash = await Dashboard(mesh.frontend.core, router=mesh.frontend.router).start()
    app = OpenAIApp(mesh.frontend.core, api_keys=KEYS, open_metrics=True, dashboard=dash)
    async with await HttpServer.start(app, "127.0.0.1", 0) as server, httpx2.AsyncClient(base_url=server.url) as c:
        for path in ("/metrics", "/dashboard", "/dashboard/state"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/v1/models")).status_code == 401
    await dash.aclose()


async def test_shared_client_ids_are_names_not_keys(mesh: Mesh, http: httpx2.AsyncClient) -> None:
    router = mesh.frontend.router
    assert router is not None
    seen_before = [len(e.requests) for e in mesh.engines]
    shared = "client-42"

    async def send(key: str, how: str) -> httpx2.Response:
        body: dict[str, Any] = {"model": "echo", "messages": [{"role": "user", "content": "ECHO:" + "x" * 40}], "max_tokens": 40}
        headers = auth(key)
        if how == "header":
            headers["x-request-id"] = shared
        else:
            body["request_id"] = shared
        return await http.post("/v1/chat/completions", json=body, headers=headers)

    replies = await asyncio.gather(send(TEAM_A, "header"), send(TEAM_B, "body"), send(TEAM_A, "body"), send(TEAM_B, "header"))
    for r in replies:
        assert r.status_code == 200, r.text
        assert r.json()["id"] == shared and r.headers["x-request-id"] == shared
        assert r.json()["choices"][0]["message"]["content"] == "x" * 40
    sent = [req for e, n in zip(mesh.engines, seen_before, strict=True) for req in e.requests[n:]]
    mesh_ids = {req["request_id"] for req in sent}
    assert len(sent) == 4 and len(mesh_ids) == 4 and shared not in " ".join(mesh_ids)
    assert {req["annotations"]["client_request_id"] for req in sent} == {shared}
    assert sorted(req["annotations"]["tenant"] for req in sent) == ["team-a", "team-a", "team-b", "team-b"]
    await wait_until(lambda: router.load.charges() == 0)
    assert all(router.load.get((w.id, 0)).in_flight == 0 for w in router.pool.all())


async def test_the_dashboard_shows_no_request_id(mesh: Mesh, http: httpx2.AsyncClient) -> None:
    made = await http.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": "ECHO:hi"}], "max_tokens": 4},
        headers={**auth(TEAM_A), "x-request-id": "visible-client-id"},
    )
    assert made.status_code == 200
    state = (await http.get("/dashboard/state", headers=auth(TEAM_B))).json()
    assert state["decisions"], state
    text = orjson.dumps(state).decode()
    assert "visible-client-id" not in text and "chatcmpl-" not in text and "request_id" not in text
    assert all(d["request"].startswith("r-") and len(d["request"]) == 12 for d in state["decisions"])


async def test_a_bad_x_request_id_is_a_clear_400(http: httpx2.AsyncClient) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "ECHO:hi"}], "max_tokens": 4}
    r = await http.post("/v1/chat/completions", json=body, headers={**auth(TEAM_A), "x-request-id": "x" * 300})
    assert r.status_code == 400 and "x-request-id" in r.json()["error"]["message"]
