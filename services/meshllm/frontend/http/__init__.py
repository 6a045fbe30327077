"""The frontend's HTTP edge: the ASGI app and its routes, slow-client guard, API keys, SSE writes, dashboard."""
