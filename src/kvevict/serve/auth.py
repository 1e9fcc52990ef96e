"""API keys: with ``Settings.api_key`` set, every /v1 route (and /metrics with ``protect_metrics``)
asks for ``Authorization: Bearer <key>`` and answers 401 otherwise, as vLLM's and llama.cpp's
``--api-key`` do; /health stays open for load balancers.

A pure ASGI middleware rather than a FastAPI dependency: it guards every path under /v1, unknown
ones included (a 404 would tell a stranger which routes exist), and does not wrap the response
(streaming and disconnect detection see the raw ASGI channel)."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .errors import error_body


def key_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries ``key`` as a Bearer token. compare_digest: the time
    taken does not tell how many leading characters of a guess were right."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class KeyGuard:
    def __init__(self, app, key: str, protect_metrics: bool = False, on_reject=None):
        self.app, self.key, self.on_reject = app, key, on_reject
        self.prefixes = ("/v1/", "/metrics") if protect_metrics else ("/v1/",)

    def guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith(self.prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.guarded(scope["path"]):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"").decode("latin-1")
            if not key_matches(header, self.key):
                if self.on_reject:
                    self.on_reject()
                what = "no API key" if not header else "an API key that is not this server's"
                body = error_body(
                    f"the request has {what}: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key / KVEVICT_API_KEY).",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
