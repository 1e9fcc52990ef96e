"""The HTTP API (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus
/health and Prometheus /metrics. Handlers only parse, submit and relay: every model call happens
on the engine's worker thread. With ``Settings.api_key`` the /v1 routes ask for it (``auth``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from . import responses
from .auth import KeyGuard
from .engine import Engine
from .errors import ENDED_TYPES, BadRequest, error_body
from .handle import Handle
from .logprobs import Layout
from .protocol import parse_chat, parse_completion


def create_app(engine: Engine, stop_engine_on_shutdown: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        if stop_engine_on_shutdown:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvevict", lifespan=lifespan)
    model_id = engine.settings.model_id
    started = int(time.time())
    layout = Layout(engine.tokenizer)
    if engine.settings.api_key:
        app.add_middleware(
            KeyGuard,
            key=engine.settings.api_key,
            protect_metrics=engine.settings.protect_metrics,
            on_reject=lambda: engine.metrics.add("kvevict_requests_total", outcome="unauthorized"),
        )

    @app.exception_handler(BadRequest)
    async def bad_request(request, err: BadRequest):
        engine.metrics.add("kvevict_requests_total", outcome=err.outcome)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.get("/health")
    async def health():
        alive = engine.alive and not engine.draining
        status = "ok" if alive else ("draining" if engine.draining else "engine stopped")
        # pid: which process (which replica, under Ray Serve) answered; 503 while draining takes the
        # server out of a load balancer's rotation before it goes
        return JSONResponse(
            {"status": status, "model": model_id, "pid": os.getpid()}, status_code=200 if alive else 503
        )

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": started, "owned_by": "kvevict"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, parse_completion)

    async def _generate(request: Request, parse):
        body = await _json(request)
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise BadRequest(
                f"the model {body.get('model')!r} does not exist; this server serves {model_id!r}.",
                "model",
                status=404,
                type="NotFoundError",
            )
        req = parse(body, engine.tokenizer, engine.settings, engine.context, len(engine.budgeter.per_layer))
        handle = engine.submit(req, asyncio.get_running_loop())
        if req.stream:
            return StreamingResponse(_stream(handle), media_type="text/event-stream")
        return await _whole(handle, request)

    def logprobs(req, entries: list, offset: int = 0):
        if req.logprobs is None:
            return None
        return layout.chat(entries) if req.kind == "chat" else layout.completion(entries, offset)

    async def _whole(handle: Handle, request: Request):
        req, parts, entries, finished = handle.req, [], [], False
        watch = asyncio.create_task(_until_disconnect(request, handle))
        try:
            while True:
                event = await handle.queue.get()
                if event[0] == "gone":  # the client went away: the worker drops the row at its next step
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                if event[0] == "prompt":
                    entries += event[1]
                elif event[0] == "delta":
                    parts.append(event[1])
                    entries += event[2]
                elif event[0] == "finish":
                    finished = True
                    text = (req.prompt_text if req.echo else "") + "".join(parts)
                    return responses.whole(req, model_id, text, event[1], event[2], logprobs(req, entries))
                else:
                    finished = True
                    return _ended(event)
        finally:  # also when this handler is cancelled (shutdown): the worker must not go on for nobody
            watch.cancel()
            if not finished:
                handle.cancel()

    async def _stream(handle: Handle):
        req = handle.req
        try:
            if req.kind == "chat":
                yield responses.sse(responses.chunk(req, model_id, first=True))
            sent = 0  # characters streamed: the completions layout's text_offset
            while True:
                event = await handle.queue.get()
                if event[0] == "delta":
                    lp = logprobs(req, event[2], sent)
                    sent += len(event[1])
                    yield responses.sse(responses.chunk(req, model_id, event[1], logprobs=lp))
                elif event[0] == "finish":
                    yield responses.sse(responses.chunk(req, model_id, finish_reason=event[1]))
                    if req.include_usage:
                        yield responses.sse(responses.chunk(req, model_id, usage=event[2]))
                    break
                else:  # the status a whole response would have had, as the error's code
                    yield responses.sse(error_body(event[1], ENDED_TYPES.get(event[2], "server_error"), None, event[2]))
                    break
            yield responses.sse("[DONE]")
        finally:  # normal end, or the client went away and the server cancelled this generator
            handle.cancel()

    return app


def _ended(event) -> JSONResponse:
    """An ("error", message, status) event as the response: 504 past the deadline, 503 at shutdown,
    500 when generation failed. x-should-retry: a deadline or a failure would come again (the
    openai client otherwise retries any 5xx twice, tripling the load); a shutdown may not."""
    _, message, status = event
    return JSONResponse(
        error_body(message, ENDED_TYPES.get(status, "server_error"), None, status),
        status_code=status,
        headers={"x-should-retry": "true" if status == 503 else "false"},
    )


async def _until_disconnect(request: Request, handle: Handle) -> None:
    """Wait for the client to go away, then cancel ``handle`` and wake its handler. The body has
    been read, so the next ASGI message is ``http.disconnect`` as soon as the connection closes:
    no polling, the worker learns of it before its next step."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
    handle.queue.put_nowait(("gone",))


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON.") from None
