"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json
from quart import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error",
          500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(to_json(self.body()), status=self.status, headers=self.headers,
                        content_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
