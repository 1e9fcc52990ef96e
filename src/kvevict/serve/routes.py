"""The handlers of the HTTP API's routes over one engine: they only parse, submit and relay
(``relay``); every model call happens on the engine's worker thread."""

from __future__ import annotations

import asyncio
import json
import os
import time

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .auth import OWNER
from .engine import Engine
from .errors import BadRequest
from .logprobs import Layout
from .protocol import parse_chat, parse_completion
from .relay import Relay


class Routes:
    """One handler per route (``app.create_app`` mounts them), plus the BadRequest handler."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_id = engine.settings.model_id
        self.started = int(time.time())
        self.relay = Relay(self.model_id, Layout(engine.tokenizer))

    async def bad_request(self, request, err: BadRequest):
        self.engine.metrics.add("kvevict_requests_total", outcome=err.outcome)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def health(self):
        engine = self.engine
        alive = engine.alive and not engine.draining
        status = "ok" if alive else ("draining" if engine.draining else "engine stopped")
        # pid: which process (which replica, under Ray Serve) answered; 503 while draining takes the
        # server out of a load balancer's rotation before it goes
        return JSONResponse(
            {"status": status, "model": self.model_id, "pid": os.getpid()}, status_code=200 if alive else 503
        )

    async def metrics(self):
        return PlainTextResponse(self.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self):
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": self.started, "owned_by": "kvevict"}],
        }

    async def chat(self, request: Request):
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request):
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse):
        engine, model_id = self.engine, self.model_id
        body = await _json(request)
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise BadRequest(
                f"the model {body.get('model')!r} does not exist; this server serves {model_id!r}.",
                "model",
                status=404,
                type="NotFoundError",
            )
        req = parse(body, engine.tokenizer, engine.settings, engine.context, len(engine.budgeter.per_layer))
        if not engine.settings.prefix_cache_shared:  # the key's own prefixes only (None: no keys, all share)
            req.owner = request.scope.get("state", {}).get(OWNER)
        handle = engine.submit(req, asyncio.get_running_loop())
        if req.stream:
            return StreamingResponse(self.relay.stream(handle), media_type="text/event-stream")
        return await self.relay.whole(handle, request)


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON.") from None
