"""vLLM's runtime LoRA routes on the public port, behind the internal token.

``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``: a PEFT folder on the worker's disk)
and ``POST /v1/unload_lora_adapter`` (``lora_name``) run on the engine thread between steps and
answer as vLLM does: 200 with a line of text, or an error in the OpenAI envelope (400 for an adapter
that does not fit, 404 for an unknown name, 401 without the token). The orchestrator calls them to
load an adapter where it routes it; a client reaches them through the gateway's admin key.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.responses import PlainTextResponse

from herd.api.errors import HttpError
from herd.api.openai import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from herd.api.prompt import PromptThreads
from herd.worker.engine_protocol import ServingEngine
from herd.worker.server._body import read_body
from herd.worker.server._internal import require_token
from herd.worker.server._peer_routes import Route

__all__ = ["LOAD_LORA_PATH", "UNLOAD_LORA_PATH", "lora_routes"]

LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"


def lora_routes(
    engine: ServingEngine, token: str, *, max_body_bytes: int, threads: PromptThreads
) -> list[Route]:
    def check(request: Request) -> None:
        if not token:
            raise HttpError(
                403, "this worker has no internal token, so its adapters cannot change at runtime"
            )
        require_token(request, token)

    async def load(request: Request) -> PlainTextResponse:
        check(request)
        body = await read_body(request, LoadLoraAdapterRequest, max_bytes=max_body_bytes, threads=threads)
        path = Path(body.lora_path.removeprefix("file://"))
        await engine.call(lambda core: core.load_lora(body.lora_name, path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request) -> PlainTextResponse:
        check(request)
        body = await read_body(request, UnloadLoraAdapterRequest, max_bytes=max_body_bytes, threads=threads)
        await engine.call(lambda core: core.unload_lora(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return [(LOAD_LORA_PATH, "POST", load), (UNLOAD_LORA_PATH, "POST", unload)]
