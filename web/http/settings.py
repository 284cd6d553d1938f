"""Server settings (everything about HTTP; the engine has its own `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from web.http.cors import CorsSettings

DEFAULT_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # defaults to the model path
    max_queued_requests: int | None = None  # waiting requests beyond this get 503 + Retry-After
    max_body_bytes: int | None = None  # default: 16 MiB, or room for the largest prompt_embeds payload accepted
    http_workers: int = 4  # threads for parsing large bodies and building large responses
    grace_period: float = 30.0  # seconds in-flight requests get to finish on shutdown
    loop_lag_interval: float = 0.05
    # Bodies this large or larger have their prompt_embeds parsed as views on the body (web.http.embeds_body).
    split_embeds_bytes: int = 1 << 20
    metrics_require_key: bool = False  # --metrics-require-key: /metrics needs the API key too
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str = ""  # the prefix a proxy serves the API under
    cors: CorsSettings = CorsSettings()  # vLLM's defaults: every origin, no credentials
    log_requests: bool = False  # --enable-log-requests: a JSON line per finished request
    allow_unknown_fields: bool = False  # log and ignore request fields nobody defines, instead of a 400
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls out of free text...
    tool_call_parser: str | None = None  # ...in this format (web.chat.tools.PARSERS)
    trust_request_chat_template: bool = False  # let requests bring their own chat_template
    enable_request_id_headers: bool = False  # X-Request-Id on every response
    uds: str | None = None  # serve on this Unix domain socket instead of host:port
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (the tokenizer's configuration)
    enable_server_load_tracking: bool = False  # GET /load counts the requests the model serves now
    enable_force_include_usage: bool = False  # usage in every response, streamed ones too
    reasoning_parser: str | None = None  # split <think>...</think> into reasoning_content (web.chat.reasoning.PARSERS)

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {self.max_queued_requests}")
        for name in ("max_body_bytes", "http_workers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.grace_period < 0 or self.loop_lag_interval <= 0:
            raise ValueError("grace_period must be >= 0 and loop_lag_interval > 0")
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError("--tool-call-parser openai reads gpt-oss's harmony messages, special tokens and all: "
                             "it needs --reasoning-parser openai_gptoss")

    def open_paths(self) -> frozenset[str]:
        """Routes that answer without the API key: probes, and /metrics unless it is protected.
        Every other route, present or added later, needs the key when one is set."""
        probes = {"/health", "/ping", "/version"}
        return frozenset(probes if self.metrics_require_key else probes | {"/metrics"})

    def body_limit(self, max_embeds_payload_bytes: int | None = None) -> int:
        """The request body limit: as set, else 16 MiB, raised to fit one base64 prompt_embeds payload
        of the largest accepted size when prompt embeddings are enabled."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        if max_embeds_payload_bytes is None:
            return DEFAULT_BODY_BYTES
        return max(DEFAULT_BODY_BYTES, max_embeds_payload_bytes * 4 // 3 + (1 << 20))
