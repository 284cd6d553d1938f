"""LoRA adapters loaded and unloaded while serving: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, their bodies, answers and errors.

Like vLLM, the routes answer only when run-time updating is allowed (`--allow-runtime-lora-updating`
or `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): anyone who may call them may make the server read any
directory it can. They sit behind `--api-key` as every route but the probes. The adapter is read
and checked by the workers between steps, never on the event loop (`AsyncEngine.add_lora`); a bad
one is a 400 and the server goes on serving.
"""

from __future__ import annotations

import anyio
from quart import Response
from quart_trio import QuartTrio

from engine.api import LoRAError, LoRARequest
from engine.lora_request import check_names_given
from web.http.errors import APIError, bad_request
from web.http.requests import read_request
from web.http.state import ServerState
from web.vllm.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        return await serve_load_lora_adapter(state)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        return await serve_unload_lora_adapter(state)


async def serve_load_lora_adapter(state: ServerState) -> Response:
    """`POST /v1/load_lora_adapter`: read, check and serve an adapter. Cancellation stops the wait;
    the adapter is then not served (`AsyncEngine.add_lora`)."""
    _check_allowed(state)
    req: LoadLoRAAdapterRequest = await read_request(state, LoadLoRAAdapterRequest)
    engine = state.engine_for_request()
    name, path = req.lora_name, req.lora_path
    lora_request = LoRARequest(name, 0, path)
    check_names_given(lora_request)  # before the checks below, which read them
    if name in state.base_model_names:
        raise bad_request(f"The lora adapter name '{name}' conflicts with a served base model.", "lora_name")
    if not await anyio.Path(path).is_dir():
        raise APIError(404, f"No adapter found for {path}", param="lora_path")
    try:
        await engine.add_lora(lora_request, replace=req.load_inplace)
    except LoRAError as exc:
        raise bad_request(str(exc), "lora_path") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")


async def serve_unload_lora_adapter(state: ServerState) -> Response:
    """`POST /v1/unload_lora_adapter`: waits for the adapter's open requests to finish (they keep
    its weights), then answers. Cancellation stops the wait; the adapter stays unserved."""
    _check_allowed(state)
    req: UnloadLoRAAdapterRequest = await read_request(state, UnloadLoRAAdapterRequest)
    engine = state.engine_for_request()
    if not req.lora_name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    if req.lora_name not in engine.loras:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
    await engine.remove_lora(req.lora_name)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", content_type="text/plain")



def _check_allowed(state: ServerState) -> None:
    if not state.engine_config.allow_runtime_lora_updating:
        raise APIError(404, "loading LoRA adapters at run time is off; start the server with --enable-lora and "
                            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
