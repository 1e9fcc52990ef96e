"""API keys: with ``Settings.api_key`` set, every /v1 route (and /metrics with ``protect_metrics``)
asks for ``Authorization: Bearer <key>`` and answers 401 otherwise, as vLLM's and llama.cpp's
``--api-key`` do; /health stays open for load balancers.
Several keys may be given: a request carrying any of them passes, and the key's ``key_id`` goes
into the request's scope (``OWNER``): whose stored prompt prefixes it may reuse (``prefix_store``).

A pure ASGI middleware rather than a FastAPI dependency: it guards every path under /v1, unknown
ones included (a 404 would tell a stranger which routes exist), and does not wrap the response
(streaming and disconnect detection see the raw ASGI channel)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi.responses import JSONResponse

from .errors import error_body

OWNER = "kvevict_key_id"  # the scope's state entry naming which key a request carried


def key_id(key: str) -> str:
    """A key's name in the server's own structures: a digest, so that no key sits in them."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def key_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries ``key`` as a Bearer token. compare_digest: the time
    taken does not tell how many leading characters of a guess were right."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def matching_key(header: str | None, keys: tuple[str, ...]) -> str | None:
    """Which of ``keys`` the header carries, if any; every key is compared (the time taken does not
    tell which one came close)."""
    found = [k for k in keys if key_matches(header, k)]
    return found[0] if found else None


class KeyGuard:
    def __init__(self, app, key: str | tuple[str, ...], protect_metrics: bool = False, on_reject=None):
        self.app, self.on_reject = app, on_reject
        self.keys = (key,) if isinstance(key, str) else tuple(key)
        self.prefixes = ("/v1/", "/metrics") if protect_metrics else ("/v1/",)

    def guarded(self, path: str) -> bool:
        return path == "/v1" or path.startswith(self.prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.guarded(scope["path"]):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"").decode("latin-1")
            key = matching_key(header, self.keys)
            if key is None:
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
            scope.setdefault("state", {})[OWNER] = key_id(key)
        await self.app(scope, receive, send)
