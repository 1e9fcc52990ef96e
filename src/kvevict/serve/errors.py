"""Errors a client caused, as OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class BadRequest(ValueError):
    """A request the server refuses (HTTP ``status``) with a message that says what to change.

    ``headers`` go on the response (429 and 503: ``Retry-After``); ``outcome`` is the label
    ``kvevict_requests_total`` counts it under; ``code`` defaults to the status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code=None,
        headers: dict | None = None,
        outcome: str = "rejected",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = status if code is None else code
        self.headers, self.outcome = headers or {}, outcome

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# the type of an error that ends a request the server accepted, by HTTP status (engine events)
ENDED_TYPES = {500: "server_error", 503: "service_unavailable", 504: "timeout"}
