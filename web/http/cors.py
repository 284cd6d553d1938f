"""CORS, as vLLM configures it (`--allowed-origins/-methods/-headers`, `--allow-credentials`).

vLLM's defaults allow every origin, method and header without credentials,
so a browser client written against `vllm serve` works here unchanged.
Preflight requests (OPTIONS) are answered by Quart's automatic OPTIONS
handling, need no API key (browsers never send one on a preflight), and get
the allow headers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the settings are read by the CLI before it imports quart (web/cli.py)
    from quart import Response
    from quart_trio import QuartTrio


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins


def register(app: QuartTrio, cors: CorsSettings) -> None:
    from quart import request

    @app.after_request
    async def add_cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin is None or not cors.origin_allowed(origin):
            return response
        wildcard = "*" in cors.allowed_origins and not cors.allow_credentials
        response.headers["Access-Control-Allow-Origin"] = "*" if wildcard else origin
        if not wildcard:
            response.headers["Vary"] = "Origin"
        if cors.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            asked_headers = request.headers.get("Access-Control-Request-Headers", "")
            methods = cors.allowed_methods
            response.headers["Access-Control-Allow-Methods"] = (
                "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" if "*" in methods else ", ".join(methods))
            headers = cors.allowed_headers
            response.headers["Access-Control-Allow-Headers"] = asked_headers if "*" in headers else ", ".join(headers)
            response.headers["Access-Control-Max-Age"] = "600"
        return response
