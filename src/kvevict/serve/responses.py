"""OpenAI response objects: chat.completion, text_completion and their streamed chunks (SSE)."""

from __future__ import annotations

import json

from .protocol import GenRequest


def completion_id(req: GenRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id


def whole(
    req: GenRequest, model_id: str, text: str, finish_reason: str, usage: dict, logprobs: dict | None = None
) -> dict:
    """The non-streamed response."""
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": completion_id(req),
        "object": obj,
        "created": req.created,
        "model": model_id,
        "choices": [choice],
        "usage": usage,
    }


def chunk(
    req: GenRequest,
    model_id: str,
    text: str | None = None,
    finish_reason: str | None = None,
    first: bool = False,
    usage: dict | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk: a text delta, the finish reason, or (choices empty) the usage."""
    if usage is not None:
        choices = []
    elif req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": completion_id(req), "object": obj, "created": req.created, "model": model_id, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def sse(data) -> str:
    """One server-sent event; ``data: [DONE]`` ends an OpenAI stream."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
