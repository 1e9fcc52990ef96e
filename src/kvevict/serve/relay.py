"""A request's engine events as its HTTP response: one JSON body (``Relay.whole``) or server-sent
events (``Relay.stream``), in OpenAI's shapes. The events, on the handle's queue: ("prompt",
logprob entries), ("delta", text, logprob entries), ("finish", reason, usage), ("error", message,
status), and ("gone",) once the client of a whole response went away."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from . import responses
from .errors import ENDED_TYPES, error_body
from .handle import Handle
from .logprobs import Layout


class Relay:
    """Relays a handle's events for one model's responses; ``layout`` lays out their logprobs."""

    def __init__(self, model_id: str, layout: Layout):
        self.model_id, self.layout = model_id, layout

    def logprobs(self, req, entries: list, offset: int = 0):
        if req.logprobs is None:
            return None
        return self.layout.chat(entries) if req.kind == "chat" else self.layout.completion(entries, offset)

    async def whole(self, handle: Handle, request: Request):
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
                    return responses.whole(req, self.model_id, text, event[1], event[2], self.logprobs(req, entries))
                else:
                    finished = True
                    return _ended(event)
        finally:  # also when this handler is cancelled (shutdown): the worker must not go on for nobody
            watch.cancel()
            if not finished:
                handle.cancel()

    async def stream(self, handle: Handle):
        req, model_id = handle.req, self.model_id
        try:
            if req.kind == "chat":
                yield responses.sse(responses.chunk(req, model_id, first=True))
            sent = 0  # characters streamed: the completions layout's text_offset
            while True:
                event = await handle.queue.get()
                if event[0] == "delta":
                    lp = self.logprobs(req, event[2], sent)
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
