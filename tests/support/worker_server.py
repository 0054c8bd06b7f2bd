"""Test helpers for the worker's servers.

``ScriptedEngine`` is a narrow stand-in for ``LLMEngine``, used only where a test needs to hold the
engine still (drain, disconnect timing) or make it fail; everything else runs the real engine.
It emits one fixed token per request per step, a step waits while ``gate`` is clear, and step
number ``fail_at_step`` raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, WorkerInfo
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams

__all__ = ["ScriptedEngine", "ScriptedStats"]


@dataclass
class ScriptedStats:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    num_output: int = 0


@dataclass
class ScriptedEngine:
    model_path: Path
    token_id: int = 5
    fail_at_step: int | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    requests: dict[str, _Request] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    stats: ScriptedStats = field(default_factory=ScriptedStats)

    def __post_init__(self) -> None:
        self.gate.set()
        self.renderer = PromptRenderer.from_pretrained(self.model_path)
        self.info = WorkerInfo(
            model="scripted",
            role="unified",
            block_size=16,
            max_model_len=256,
            epoch="e1",
            dtype="float32",
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
        )
        self._events: list[KVEvent] = []
        self._seq = 0
        self._num_steps = 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        self.requests[request_id] = _Request(prompt_token_ids, params)
        self._seq += 1
        self._events.append(KVEvent(seq=self._seq, kind="stored", block_hashes=[self._seq]))

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.gate.wait(timeout=30)
        self._num_steps += 1
        if self._num_steps == self.fail_at_step:
            raise RuntimeError("scripted failure")
        return [self._advance(request_id, request) for request_id, request in list(self.requests.items())]

    def _advance(self, request_id: str, request: _Request) -> RequestOutput:
        request.num_output += 1
        self.stats.generation_tokens += 1
        finished = request.num_output >= request.params.max_tokens
        if finished:
            del self.requests[request_id]
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[self.token_id],
            new_text=self.renderer.decode([self.token_id]),
            finished=finished,
            finish_reason="length" if finished else None,
            num_prompt_tokens=len(request.prompt),
            num_cached_tokens=0,
            num_output_tokens=request.num_output,
        )

    def load_report(self) -> LoadReport:
        return LoadReport(num_running=len(self.requests))

    def drain_kv_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def kv_snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            epoch="e1", seq=self._seq, block_size=16, block_hashes=list(range(1, self._seq + 1))
        )
