"""Test helpers for the worker's servers.

``ScriptedEngine`` is a narrow stand-in for ``LLMEngine``, used only where a test needs to hold the
engine still (drain, disconnect timing) or make it fail; everything else runs the real engine.
It emits one fixed token per request per step, a step waits while ``gate`` is clear, and step
number ``fail_at_step`` raises.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from herd.api.crd import EngineSpec
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, WorkerInfo
from herd.worker.config import EngineConfig
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams
from herd.worker.stats import EngineStats
from support.gateway_fakes import sse_events
from support.procs import free_port, running, wait_until

__all__ = [
    "ScriptedEngine",
    "WorkerProcess",
    "engine_config",
    "metric_value",
    "sse_data",
    "worker_argv",
    "worker_process",
]


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
    stats: EngineStats = field(default_factory=EngineStats)
    lora_adapters: dict[str, Path] = field(default_factory=dict)

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
            vocab_size=self.renderer.vocab_size,
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
        first_token_id: int | None = None,
        resumed_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> RequestOutput | None:
        if first_token_id is not None or resumed_token_ids:
            raise ValueError("the scripted engine takes no handed-over or resumed tokens")
        self.requests[request_id] = _Request(prompt_token_ids, params)
        self._seq += 1
        self._events.append(KVEvent(seq=self._seq, kind="stored", block_hashes=[self._seq]))
        return None

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

    def close(self) -> None:
        """Nothing runs beside it."""


def engine_config(model_path: Path, **engine: Any) -> EngineConfig:
    """A small CPU engine for tests: short context, a small KV pool; ``engine`` adds camelCase fields."""
    spec = {"device": "cpu", "maxModelLen": 256, "kvCache": {"blockSize": 16, "memoryGiB": 0.02}, **engine}
    return EngineConfig(model_path=model_path, served_name="tiny", engine=EngineSpec.model_validate(spec))


def sse_data(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in sse_events(text.encode())]


@dataclass(frozen=True)
class WorkerProcess:
    url: str
    internal_url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def worker_process(model_path: Path, *, log: Path, token: str, **flags: str) -> Iterator[WorkerProcess]:
    """A ``herd worker`` subprocess on free loopback ports, ready to serve; stopped by its pid."""
    port, internal_port = free_port(), free_port()
    argv = worker_argv(model_path, port=port, internal_port=internal_port, token=token, **flags)
    with running(argv, log=log) as process:
        url = f"http://127.0.0.1:{port}"

        def is_ready() -> bool:
            assert process.poll() is None, f"herd worker exited early; see {log}"
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200

        wait_until(is_ready, timeout=120, interval=0.2, what=f"herd worker (pid {process.pid}) ready")
        yield WorkerProcess(url, f"http://127.0.0.1:{internal_port}", process)


def worker_argv(model_path: Path, *, port: int, internal_port: int, token: str, **flags: str) -> list[str]:
    """``herd worker`` as a subprocess command line, on a small CPU engine; ``flags`` add ``--name value``."""
    argv = [
        sys.executable,
        "-m",
        "herd.cli.main",
        "worker",
        "--model",
        str(model_path),
        "--served-name",
        "tiny",
        "--port",
        str(port),
        "--internal-port",
        str(internal_port),
        "--internal-token",
        token,
        "--device",
        "cpu",
        "--max-model-len",
        "512",
        "--kv-memory-gib",
        "0.05",
        "--log-level",
        "WARNING",
    ]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", value]
    return argv


def metric_value(text: str, name: str) -> float:
    """The first sample of ``name`` in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith((f"{name}{{", f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} is not on the metrics page")
