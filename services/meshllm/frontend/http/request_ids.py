"""Who a request is and what it is called: its tenant, the client's own request id, its trace context.

The tenant is the id of the API key the request was let in with (`TENANT_KEY`
in the ASGI scope, set by the app's key check; `ANONYMOUS` without keys). A
client's request id (`x-request-id`, else the body's `request_id`) names the
response and is echoed back; it is never a key inside the mesh, where every
request gets an id the frontend makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace

from meshllm.errors import InvalidArgument
from meshllm.frontend.http.asgi import Scope, header
from meshllm.frontend.http.auth import ANONYMOUS
from meshllm.plane.request.transport import CallInfo

if TYPE_CHECKING:
    from meshllm.frontend.openai.inference import Completion
    from meshllm.protocol.openai import TextRequest

__all__ = ["REQUEST_ID_HEADER", "TENANT_KEY", "annotate_span", "call_info", "client_request_id", "path_id", "tenant_of"]

TENANT_KEY = "meshllm.tenant"  # scope key: the tenant (API key id) a request was let in as
REQUEST_ID_HEADER = b"x-request-id"
MAX_CLIENT_ID_CHARS = 256


def annotate_span(completion: Completion, client_id: str | None) -> None:
    """The request's ids and tenant on its server span (traces name the client's id beside the mesh's)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("meshllm.request_id", completion.internal_id)
        span.set_attribute("meshllm.tenant", completion.tenant)
        if client_id is not None:
            span.set_attribute("meshllm.client_request_id", client_id)


def tenant_of(scope: Scope) -> str:
    return scope.get(TENANT_KEY, ANONYMOUS)


def path_id(scope: Scope, prefix: str) -> str:
    return scope["path"].rstrip("/").removeprefix(prefix)


def client_request_id(scope: Scope, req: TextRequest) -> str | None:
    """The client's own id of a request: `x-request-id`, else the body's `request_id`; never a key inside the mesh."""
    value = header(scope, REQUEST_ID_HEADER)
    if value is None:
        return req.request_id
    text = value.decode("latin-1").strip()
    if not text or len(text) > MAX_CLIENT_ID_CHARS or not text.isprintable():
        raise InvalidArgument(f"the x-request-id header must be 1-{MAX_CLIENT_ID_CHARS} printable characters")
    return text


def call_info(scope: Scope) -> CallInfo | None:
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            return CallInfo(traceparent=value.decode("latin-1"))
    return None
