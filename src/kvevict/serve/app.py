"""The HTTP API (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus
/health and Prometheus /metrics. Handlers only parse, submit and relay: every model call happens
on the engine's worker thread."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import responses
from .engine import Engine, Handle
from .errors import BadRequest, error_body
from .protocol import parse_chat, parse_completion

POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def create_app(engine: Engine, stop_engine_on_shutdown: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        if stop_engine_on_shutdown:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvevict", lifespan=lifespan)
    model_id = engine.settings.model_id
    started = int(time.time())

    @app.exception_handler(BadRequest)
    async def bad_request(request, err: BadRequest):
        engine.metrics.add("kvevict_requests_total", outcome="rejected")
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health():
        alive = engine.alive
        # pid: which process (which replica, under Ray Serve) answered
        return JSONResponse({"status": "ok" if alive else "engine stopped", "model": model_id, "pid": os.getpid()},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": started,
                                            "owned_by": "kvevict"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, parse_completion)

    async def _generate(request: Request, parse):
        body = await _json(request)
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise BadRequest(f"the model {body.get('model')!r} does not exist; this server serves {model_id!r}.",
                             "model", status=404, type="NotFoundError")
        req = parse(body, engine.tokenizer, engine.settings, engine.context, len(engine.budgeter.per_layer))
        handle = engine.submit(req, asyncio.get_running_loop())
        if req.stream:
            return StreamingResponse(_stream(handle), media_type="text/event-stream")
        return await _whole(handle, request)

    async def _whole(handle: Handle, request: Request):
        parts, finished = [], False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(handle.queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()  # the worker drops the sequence at its next step
                        return JSONResponse(error_body("client disconnected"), status_code=499)
                    continue
                if event[0] == "delta":
                    parts.append(event[1])
                elif event[0] == "finish":
                    finished = True
                    return responses.whole(handle.req, model_id, "".join(parts), event[1], event[2])
                else:
                    finished = True
                    return JSONResponse(error_body(event[1], "server_error"), status_code=500)
        finally:  # also when this handler is cancelled (shutdown): the worker must not go on for nobody
            if not finished:
                handle.cancel()

    async def _stream(handle: Handle):
        req = handle.req
        try:
            if req.kind == "chat":
                yield responses.sse(responses.chunk(req, model_id, first=True))
            while True:
                event = await handle.queue.get()
                if event[0] == "delta":
                    yield responses.sse(responses.chunk(req, model_id, event[1]))
                elif event[0] == "finish":
                    yield responses.sse(responses.chunk(req, model_id, finish_reason=event[1]))
                    if req.include_usage:
                        yield responses.sse(responses.chunk(req, model_id, usage=event[2]))
                    break
                else:
                    yield responses.sse(error_body(event[1], "server_error"))
                    break
            yield responses.sse("[DONE]")
        finally:  # normal end, or the client went away and the server cancelled this generator
            handle.cancel()

    return app


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON.") from None
