"""The server's error type: an HTTP status and an OpenAI-style JSON body."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``.

    ``status`` is the HTTP status (4xx for the client's mistakes, 429 when the queue is full, 5xx only for
    failures of the server itself); ``message`` is a complete sentence naming the problem; ``param`` the
    request field involved (``"messages[0].content[1].image_url.url"``), if any.
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 413:
        return "request_too_large"
    if status == 404:
        return "not_found_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"
