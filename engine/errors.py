"""Errors the engine raises to its callers.

`InvalidRequestError` is a `ValueError`: it means "this request is wrong", the
HTTP layer answers it with a 400, and the engine keeps serving everyone else.
`EngineDeadError` means the engine itself stopped; every pending and later
request fails with it.
"""


class InvalidRequestError(ValueError):
    """A request (prompt, sampling parameters, ...) is invalid; nothing was run."""

    def __init__(self, message: str, *, param: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, as OpenAI's error `param`
        self.request_id = request_id  # which request of a batch was refused, when the engine knows


class RequestFailedError(RuntimeError):
    """One request failed inside a step (its own inputs broke it); the engine serves the rest."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ModelLoadError(ValueError):
    """A model directory cannot be loaded: missing files, unknown architecture, bad weights."""


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served; the message is one line naming the adapter and why."""


class EngineDeadError(RuntimeError):
    """The engine stopped (it was closed or its step loop failed); it serves no more requests."""
