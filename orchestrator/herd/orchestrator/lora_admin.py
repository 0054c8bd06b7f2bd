"""Runtime LoRA adapters at the gateway: vLLM's load and unload routes, behind an admin API key.

``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``: the PEFT folder as the workers see it,
and herd's ``model``: the base model, needed only when the gateway serves several) loads the adapter
on every worker of the model and remembers its folder, so a worker that joins later, or restarts,
loads it when a request for it is first routed there. ``POST /v1/unload_lora_adapter`` unloads it
everywhere and forgets it. Both answer as vLLM does (200 with a line of text), or an error in the
OpenAI envelope: 401/403 without an admin key, 404 for an unknown model or adapter, a worker's own
refusal of the adapter with its status (400, 404, 409), 502 for any other answer from a worker. A
load a worker refuses is undone on the workers that took it.
"""

from __future__ import annotations

import logging

from herd.api.errors import HttpError
from herd.api.openai import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.registry import Registry
from herd.orchestrator.served import ServedModel

__all__ = ["ADMIN_PATHS", "LOAD_LORA_PATH", "UNLOAD_LORA_PATH", "LoraAdmin"]

LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
ADMIN_PATHS = frozenset({LOAD_LORA_PATH, UNLOAD_LORA_PATH})
"""Checked against the admin keys instead of the clients' keys."""

log = logging.getLogger(__name__)


class LoraAdmin:
    def __init__(self, registry: Registry, admin_keys: ApiKeys) -> None:
        self.registry = registry
        self.admin_keys = admin_keys

    def check(self, authorization: str | None) -> None:
        if not self.admin_keys.is_enabled:
            raise HttpError(403, "this gateway has no admin API key, so adapters cannot change at runtime")
        if not self.admin_keys.allows(authorization):
            raise HttpError(401, "missing or invalid admin API key: send `Authorization: Bearer <admin key>`")

    async def load(self, body: LoadLoraAdapterRequest) -> str:
        """Load on every worker of the model, or on none: a worker's refusal unloads the adapter from
        the workers this call loaded it on, so it is not served by some and a retry is not told the
        name is taken."""
        served = self._model(body)
        change = {"lora_name": body.lora_name, "lora_path": body.lora_path}
        loaded: list[str] = []
        try:
            for worker in self.registry.model_workers(served.name):
                had_it = body.lora_name in worker.report.lora_adapters
                await self.registry.change_lora(worker.endpoint.id, "load", change)
                if not had_it:
                    loaded.append(worker.endpoint.id)
        except HttpError:
            await self._unload_from(loaded, body.lora_name)
            raise
        served.lora_paths[body.lora_name] = body.lora_path
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def _unload_from(self, worker_ids: list[str], lora_name: str) -> None:
        """Undo a partial load; a worker that cannot unload is logged, the load's own error stands."""
        for worker_id in worker_ids:
            try:
                await self.registry.change_lora(worker_id, "unload", {"lora_name": lora_name})
            except HttpError as error:
                log.warning(
                    "LoRA adapter load failed and could not be undone on a worker: %s",
                    error.message,
                    extra={"worker": worker_id, "adapter": lora_name},
                )

    async def unload(self, body: UnloadLoraAdapterRequest) -> str:
        served = self._model(body)
        holders = [
            worker.endpoint.id
            for worker in self.registry.model_workers(served.name)
            if body.lora_name in worker.report.lora_adapters
        ]
        if not holders and body.lora_name not in served.lora_paths:
            raise HttpError(
                404,
                f"LoRA adapter {body.lora_name!r} is not loaded on model {served.name!r}",
                param="lora_name",
            )
        for worker_id in holders:
            await self.registry.change_lora(worker_id, "unload", {"lora_name": body.lora_name})
        served.lora_paths.pop(body.lora_name, None)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _model(self, body: LoadLoraAdapterRequest | UnloadLoraAdapterRequest) -> ServedModel:
        """The base model the body names (herd's ``model`` field), or the only one served."""
        models = self.registry.models
        name = getattr(body, "model", None)
        if name is None and len(models) == 1:
            return next(iter(models.values()))
        if not isinstance(name, str) or name not in models:
            known = ", ".join(sorted(models)) or "none"
            raise HttpError(404, f"name the base model in `model` (served: {known})", param="model")
        return models[name]
