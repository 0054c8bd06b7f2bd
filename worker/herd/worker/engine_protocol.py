"""What the worker's layers need from the engine below them, as protocols.

``EngineCore`` is the synchronous engine (``herd.worker.engine.LLMEngine``, whatever its runner)
as the async front drives it and as the server's commands see it on the engine thread: requests,
steps, load, KV events, and the KV block moves of disaggregation, which every engine has (a
runner without data moves placeholders). ``ServingEngine`` is the async front
(``herd.worker.async_engine.AsyncEngine``) as the HTTP server uses it; the server is typed
against it alone, so another front can serve the same routes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from herd.api.kv_hash import BlockHash
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, WorkerInfo
from herd.worker.block_manager import HeldRun
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams
from herd.worker.stats import EngineStats

if TYPE_CHECKING:
    import asyncio

    import torch

__all__ = ["EngineCore", "ServingEngine"]

T = TypeVar("T")


class EngineCore(Protocol):
    """The synchronous engine; not thread-safe: one thread steps it and runs commands between steps."""

    @property
    def renderer(self) -> PromptRenderer: ...

    @property
    def info(self) -> WorkerInfo: ...

    @property
    def stats(self) -> EngineStats: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        first_token_id: int | None = None,
        resumed_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> RequestOutput | None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def load_report(self) -> LoadReport: ...

    def reset_prefix_cache(self) -> bool: ...

    def close(self) -> None:
        """Stop what the engine started beside its thread (tensor-parallel ranks); the last call."""
        ...

    def drain_kv_events(self) -> list[KVEvent]: ...

    def kv_snapshot(self) -> KVSnapshot: ...

    # Disaggregation: whole KV blocks leave a prefill engine and enter a decode engine's cache.

    def release_held(self, request_id: str) -> int: ...

    def hold_cached(self, request_id: str, block_hashes: list[BlockHash]) -> HeldRun: ...

    def record_pull(self, num_bytes: int, seconds: float) -> None: ...

    def missing_blocks(self, block_hashes: list[BlockHash]) -> list[int]: ...

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(
        self,
        block_hashes: list[BlockHash],
        token_blocks: list[list[int]],
        kv: torch.Tensor,
        lora_name: str | None = None,
    ) -> int: ...

    # LoRA adapters: loaded and unloaded between steps.

    @property
    def lora_adapters(self) -> dict[str, Path]: ...

    def load_lora(self, name: str, path: Path) -> None: ...

    def unload_lora(self, name: str) -> None: ...


class ServingEngine(Protocol):
    """The async front as the server uses it: lifecycle, requests, reads, and commands that run
    on the engine thread (``call``, ``submit``) or beside it (``run_beside``)."""

    @property
    def error(self) -> Exception | None: ...

    @property
    def is_loaded(self) -> bool: ...

    @property
    def is_ready(self) -> bool:
        """Loaded, not failed, not draining: what ``/ready`` answers 200 for."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def step_observers(self) -> list[Callable[[float], None]]: ...

    @property
    def info(self) -> WorkerInfo: ...

    @property
    def renderer(self) -> PromptRenderer: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_kv_events(self) -> int: ...

    @property
    def lora_adapters(self) -> Mapping[str, Path]: ...

    def start(self) -> None: ...

    async def wait_loaded(self) -> None: ...

    async def wait_failed(self) -> None: ...

    async def drain(self, grace_s: float) -> bool: ...

    async def stop(self) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        first_token_id: int | None = None,
        resumed_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def check_accepting(self) -> None: ...

    async def call(self, function: Callable[[EngineCore], T]) -> T: ...

    def submit(self, function: Callable[[EngineCore], T]) -> asyncio.Future[T]: ...

    async def run_beside(self, function: Callable[[EngineCore], T]) -> T: ...

    def load_report(self) -> LoadReport: ...

    async def kv_snapshot(self) -> KVSnapshot: ...

    async def kv_events_after(self, seq: int, *, wait: float = 0.0) -> list[KVEvent]: ...
