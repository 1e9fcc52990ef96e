"""Errors a client caused, as OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class BadRequest(ValueError):
    """A request the server refuses (HTTP ``status``) with a message that says what to change."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
