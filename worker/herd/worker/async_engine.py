"""The asyncio front of the synchronous engine.

One dedicated thread owns the engine: it builds it, runs ``step()`` while work is pending, and
executes commands (add, abort, snapshot) queued to it from the event loop between steps, so the
engine needs no locks and the event loop never blocks on compute. Outputs travel back through
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request. Cancelling the task that
consumes ``generate`` (a client disconnect) queues an abort, which the thread runs before its next
step, so the sequence's blocks are freed at once. KV events are kept in a bounded log for the
internal events endpoint and fanned out to live subscribers.

A request the engine failed (its output carries an ``error``) raises ``RequestFailedError`` in its
``generate`` only. An exception escaping ``step`` or a command means the engine could not recover:
every request in flight fails with ``EngineDeadError``, and ``wait_failed`` returns so that the
process can exit and be restarted by its supervisor instead of lingering unable to serve.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from herd.api.kv_events import KVEventFeed
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, WorkerInfo
from herd.worker.engine_protocol import EngineCore
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import InvalidParamError, SamplingParams
from herd.worker.stats import EngineStats

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineDrainingError",
    "RequestFailedError",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_WAIT_S = 0.5
"""How long the idle engine thread sleeps on its command queue before checking for shutdown."""
_KV_EVENT_LOG_LEN = 65536
"""KV events kept for pollers; one that falls further behind sees a gap and asks for a snapshot."""


class EngineDrainingError(RuntimeError):
    """The worker is shutting down and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine failed to load or failed during a step; the worker must be restarted.

    ``reached_engine`` tells a request that was in the engine when it died (its failure may be its
    own doing: not to be retried elsewhere) from one refused afterwards (it never reached it).
    """

    def __init__(self, message: str, *, reached_engine: bool = False) -> None:
        super().__init__(message)
        self.reached_engine = reached_engine


class RequestFailedError(RuntimeError):
    """The engine failed this one request (and logged why); it keeps serving the others."""


_Command = Callable[[EngineCore], None]


class AsyncEngine:
    """Runs an ``EngineCore`` on its own thread and exposes it to asyncio code (a ``ServingEngine``).

    ``start()`` must be called from the event loop that will consume the outputs; the engine is
    built on the engine thread by ``factory`` (loading a model takes a while), and ``is_ready``
    turns true once it is.
    """

    def __init__(self, factory: Callable[[], EngineCore]) -> None:
        self._factory = factory
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._outputs: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._kv_events = KVEventFeed(_KV_EVENT_LOG_LEN)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: EngineCore | None = None
        self._load = LoadReport()
        self._stopping = threading.Event()
        self._loaded = asyncio.Event()
        self._failed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.is_draining = False
        self.error: Exception | None = None
        self.step_observers: list[Callable[[float], None]] = []
        """Called on the engine thread with each step's duration in seconds (metrics)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="herd-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> None:
        """Return once the engine is built; raise ``EngineDeadError`` if building it failed."""
        await self._loaded.wait()
        if self.error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.error}") from self.error

    async def wait_failed(self) -> None:
        """Return once the engine has failed beyond recovery (never, while it serves)."""
        await self._failed.wait()

    @property
    def is_loaded(self) -> bool:
        return self._engine is not None

    @property
    def is_ready(self) -> bool:
        return self.is_loaded and self.error is None and not self.is_draining

    @property
    def num_in_flight(self) -> int:
        return len(self._outputs)

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests and wait up to ``grace_s`` seconds for in-flight ones to finish."""
        self.is_draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            logger.warning("drain timed out", extra={"num_in_flight": self.num_in_flight})
            return False
        return True

    async def stop(self) -> None:
        """Stop the engine thread (after ``drain``); requests still in flight fail."""
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for target in self._outputs.values():
            target.put_nowait(EngineDrainingError("the worker stopped before this request finished"))

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        first_token_id: int | None = None,
        resumed_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request (with LoRA adapter ``lora_name``, or the base model) and yield its outputs
        until it finishes.

        A ``first_token_id`` handed over by a prefill worker, or the ``resumed_token_ids`` of a stream
        another worker began (one output, ``is_resumed``), is yielded as soon as the request is
        added, before any step computes. Raises the engine's admission errors (``QueueFullError``,
        ``PromptTooLongError``) before the first output, ``EngineDrainingError`` while draining,
        ``ValueError`` on a duplicate id. Closing or cancelling the iteration aborts the request.
        """
        self.check_accepting()
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in flight; send a unique X-Request-Id")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._outputs[request_id] = outputs
        self._idle.clear()
        # Commands run in order, so an abort queued after a cancelled add still removes it.
        needs_abort = True
        try:
            try:
                first = await self.call(
                    lambda engine: engine.add_request(
                        request_id,
                        prompt_token_ids,
                        params,
                        cache_salt=cache_salt,
                        first_token_id=first_token_id,
                        resumed_token_ids=resumed_token_ids,
                        lora_name=lora_name,
                    )
                )
            except Exception:
                needs_abort = False
                raise
            if first is not None:
                needs_abort = not first.finished
                yield _checked(first)
            while needs_abort:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                needs_abort = not item.finished
                yield _checked(item)
        finally:
            self._forget(request_id, abort=needs_abort)

    def check_accepting(self) -> None:
        """Raise the reason this engine takes no new request now, if there is one."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        if self.is_draining:
            raise EngineDrainingError("this worker is draining for shutdown; retry on another worker")
        if self._engine is None:
            raise EngineDrainingError("the model is still loading; retry when /ready answers 200")

    def _forget(self, request_id: str, *, abort: bool) -> None:
        self._outputs.pop(request_id, None)
        if abort:
            self._commands.put(lambda engine: engine.abort_request(request_id))
        if not self._outputs:
            self._idle.set()

    async def call(self, function: Callable[[EngineCore], T]) -> T:
        """Run ``function(engine)`` on the engine thread between steps and return its result."""
        return await self.submit(function)

    def submit(self, function: Callable[[EngineCore], T]) -> asyncio.Future[T]:
        """Queue ``function(engine)`` for the engine thread now; its result arrives in the future.

        Unlike ``call``, the command is queued before this returns, so a command queued next (an
        ``add_request`` from ``generate``) runs after it, usually in the same pause between steps.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command(engine: EngineCore) -> None:
            try:
                result = function(engine)
            except Exception as error:
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(command)
        return future

    async def run_beside(self, function: Callable[[EngineCore], T]) -> T:
        """Run ``function(engine)`` on a pool thread while the engine thread keeps stepping.

        Only for reads that no step can change: KV blocks held by a lease (a held, full block is
        never written nor reallocated), or a lookup whose staleness the caller tolerates.
        """
        engine = self._require_engine()
        return await asyncio.to_thread(function, engine)

    # -- reads -------------------------------------------------------------------------------

    @property
    def info(self) -> WorkerInfo:
        return self._require_engine().info

    @property
    def renderer(self) -> PromptRenderer:
        return self._require_engine().renderer

    @property
    def stats(self) -> EngineStats:
        return self._require_engine().stats

    @property
    def lora_adapters(self) -> Mapping[str, Path]:
        """The adapters loaded (changed only by commands on the engine thread; a read is atomic)."""
        return self._require_engine().lora_adapters

    def load_report(self) -> LoadReport:
        """The load as of the last step (no wait on the engine thread)."""
        return self._load.model_copy(update={"is_draining": self.is_draining})

    async def kv_snapshot(self) -> KVSnapshot:
        self._require_engine()
        return await self.call(lambda engine: engine.kv_snapshot())

    @property
    def num_kv_events(self) -> int:
        return self._kv_events.num_published

    async def kv_events_after(self, seq: int, *, wait: float = 0.0) -> list[KVEvent]:
        """Logged KV events with ``seq`` above ``seq``; waits up to ``wait`` s for one if none yet."""
        return await self._kv_events.after(seq, wait=wait)

    def subscribe_kv_events(self) -> AsyncGenerator[KVEvent, None]:
        """Every KV event from now on, in order, until the iteration is closed."""
        return self._kv_events.subscribe()

    def _require_engine(self) -> EngineCore:
        if self._engine is None:
            raise EngineDrainingError("the model is still loading; retry when /ready answers 200")
        return self._engine

    # -- event loop side of the engine thread ------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput], events: list[KVEvent], load: LoadReport) -> None:
        self._load = load
        for output in outputs:
            if (target := self._outputs.get(output.request_id)) is not None:
                target.put_nowait(output)
        if events:
            self._kv_events.publish(events)

    def _fail_all(self, error: Exception) -> None:
        self.error = error
        for target in self._outputs.values():
            target.put_nowait(EngineDeadError(f"the engine failed: {error}", reached_engine=True))
        self._failed.set()

    def _on_loaded(self, engine: EngineCore | None, error: Exception | None) -> None:
        self._engine, self.error = engine, error
        self._loaded.set()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        assert self._loop is not None
        try:
            engine = self._factory()
        except Exception as error:
            logger.exception("the engine failed to load")
            self._loop.call_soon_threadsafe(self._on_loaded, None, error)
            return
        self._loop.call_soon_threadsafe(self._on_loaded, engine, None)
        try:
            self._loop_steps(engine)
        except Exception as error:
            logger.exception("the engine failed; this worker needs a restart")
            self._loop.call_soon_threadsafe(self._fail_all, error)
        finally:
            engine.close()

    def _loop_steps(self, engine: EngineCore) -> None:
        assert self._loop is not None
        while not self._stopping.is_set() and not self._loop.is_closed():
            self._run_commands(engine, block=not engine.has_unfinished_requests())
            outputs = self._timed_step(engine) if engine.has_unfinished_requests() else []
            self._loop.call_soon_threadsafe(
                self._deliver, outputs, engine.drain_kv_events(), engine.load_report()
            )

    def _run_commands(self, engine: EngineCore, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        command(engine)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command(engine)

    def _timed_step(self, engine: EngineCore) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        for observe in self.step_observers:
            observe(elapsed)
        return outputs


def _checked(output: RequestOutput) -> RequestOutput:
    if output.error_param is not None:
        raise InvalidParamError(output.error_param, output.error or "")
    if output.error is not None:
        raise RequestFailedError(output.error)
    return output


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
