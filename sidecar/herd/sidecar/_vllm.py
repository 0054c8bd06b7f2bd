"""What the sidecar learns from the vLLM server beside it: its cache geometry, context length and
load (over HTTP, on loopback), and the model's layout from the model folder it serves."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx

from herd.api.errors import HttpError
from herd.api.protocol import LoadReport, Role, WorkerInfo
from herd.sidecar._metrics import CacheGeometry, MetricsError, cache_geometry, load_report

__all__ = ["VLLMView", "model_layout"]

logger = logging.getLogger(__name__)

_POLL_TIMEOUT = httpx.Timeout(5.0)
_RETRY_AFTER = {"Retry-After": "1"}


def model_layout(folder: Path) -> dict[str, Any]:
    """``WorkerInfo``'s model fields from the folder's ``config.json`` (HF names, their defaults)."""
    config = json.loads((folder / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    return {
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // num_heads,
        "vocab_size": config.get("vocab_size"),
        "dtype": config.get("torch_dtype") or config.get("dtype") or "auto",
    }


class VLLMView:
    """The vLLM server as herd's contract needs it; ``learn`` waits until it has served once."""

    def __init__(
        self, vllm: httpx.AsyncClient, *, served_name: str, role: Role, layout: dict[str, Any]
    ) -> None:
        self.vllm = vllm
        self.served_name, self.role, self.layout = served_name, role, layout
        self.geometry: CacheGeometry | None = None
        self.max_model_len: int | None = None
        self.is_draining = False

    @property
    def is_learned(self) -> bool:
        return self.geometry is not None

    async def learn(self, *, interval_s: float = 1.0) -> CacheGeometry:
        """Poll vLLM until its cache is allocated and it lists the served model (it loads for minutes)."""
        while True:
            try:
                self.max_model_len = await self._max_model_len()
                self.geometry = cache_geometry(await self._metrics())
                return self.geometry
            except (httpx.HTTPError, MetricsError, LookupError) as error:
                logger.debug("vLLM is not up yet", extra={"error": str(error)})
            await asyncio.sleep(interval_s)

    def info(self, epoch: str) -> WorkerInfo:
        geometry = self._require_geometry()
        assert self.max_model_len is not None
        return WorkerInfo(
            model=self.served_name,
            role=self.role,
            block_size=geometry.block_size,
            max_model_len=self.max_model_len,
            epoch=epoch,
            **self.layout,
        )

    async def load(self) -> LoadReport:
        geometry = self._require_geometry()
        try:
            text = await self._metrics()
        except httpx.HTTPError as error:
            raise HttpError(
                503, f"vLLM's /metrics did not answer ({error}); retry shortly", headers=_RETRY_AFTER
            ) from None
        try:
            return load_report(text, geometry.num_blocks, is_draining=self.is_draining)
        except MetricsError as error:
            raise HttpError(503, f"{error}; retry shortly", headers=_RETRY_AFTER) from None

    def _require_geometry(self) -> CacheGeometry:
        if self.geometry is None:
            raise HttpError(503, "vLLM is still loading; retry when /ready answers 200", headers=_RETRY_AFTER)
        return self.geometry

    async def _metrics(self) -> str:
        response = await self.vllm.get("/metrics", timeout=_POLL_TIMEOUT)
        response.raise_for_status()
        return response.text

    async def _max_model_len(self) -> int:
        response = await self.vllm.get("/v1/models", timeout=_POLL_TIMEOUT)
        response.raise_for_status()
        models = {model["id"]: model for model in response.json()["data"]}
        return int(models[self.served_name]["max_model_len"])
