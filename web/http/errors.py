"""Errors as vLLM writes them: {"error": {"message", "type", "param", "code"}}, `type` the error
class's name (`BadRequestError`, `NotFoundError`, ...) and `code` the HTTP status, for every 4xx and
5xx. OpenAI's own clients read only the status and the message, so both kinds of client work; the
reason this server had for a 503 or a 401 (`engine_dead`, `invalid_api_key`, ...) stays readable
as `reason`. docs/decisions.md has the choice."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json
from quart import Response

_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestEntityTooLargeError", 429: "TooManyRequestsError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


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
        error: dict[str, Any] = {"message": self.message, "type": _TYPES.get(self.status, "InternalServerError"),
                                 "param": self.param, "code": self.status}
        if self.code is not None:
            error["reason"] = self.code
        return {"error": error}

    def response(self) -> Response:
        return Response(to_json(self.body()), status=self.status, headers=self.headers,
                        content_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
