"""Running batches: each line through the gateway at the lowest priority, its answer appended to disk.

A batch's lines go through ``Gateway.forward`` like any request of its tenant (its quotas and models
apply, as the keys define the tenant when the batch runs: one narrowed since the batch was created
gets no more than a direct request would, one removed gets its batch failed), with
``X-Herd-Priority: BATCH_PRIORITY``: they wait behind every interactive request in the gateway's
queue and in each engine's, and are preempted first, so a batch fills the capacity that
interactive traffic leaves. At most ``concurrency`` lines of a batch are in flight at once.

Durability: the batch's record and every answered line are on disk (``BatchStore``) before the next
step. On start, ``resume`` picks up every batch that had not finished, reads which ``custom_id``
already have an output or error line, and runs only the others: a restarted gateway loses no batch
and repeats no line (a line in flight at the crash had written nothing, and runs again). The writes
(an append and two records, each fsync'd) run in a thread, off the event loop, and the answers that
come in while one write is under way go together in the next (one append, one fsync): on the loop
they held up every interactive stream the gateway relays, by milliseconds a line and by hundreds
when the disk was busy (docs/benchmarks.md, the batch interference section).

A refusal that says "not now" (429 or 503: no worker ready yet, the fleet at capacity, a quota's
minute used up) is no answer to the line: it is sent again after the refusal's ``Retry-After`` (else
a backoff from ``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``) until it is answered, the batch is
cancelled or its completion window ends. A batch is the work that waits for spare capacity, so
it must not fail because none was spare at the moment a line was tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response

from herd.api.errors import HttpError
from herd.orchestrator.admission.tenants import BATCH_PRIORITY, PRIORITY_HEADER, Tenant
from herd.orchestrator.batch.lines import (
    BatchLine,
    InputError,
    done_ids,
    error_line,
    output_line,
    parse_input,
)
from herd.orchestrator.batch.store import BatchRecord, BatchStore, FileRecord, RequestCounts

__all__ = ["BatchRunner", "Forward", "cancelling"]

log = logging.getLogger(__name__)

Forward = Callable[[str, bytes, Mapping[str, str], Tenant], Awaitable[Response]]
"""``Gateway.forward``."""
Tenants = Callable[[str], Tenant | None]
"""The tenant of a name as the keys define it now, ``None`` when none has it (``ApiKeys.tenant_named``)."""
INTERNAL_ERROR = "internal error while running the batch; see the orchestrator log"
"""What a client sees of a defect; the detail (which may name server paths) goes to the log only."""
_HEADERS = {PRIORITY_HEADER: str(BATCH_PRIORITY)}
RETRY_STATUSES = frozenset({429, 503})
"""Refusals that mean "not now": the line is sent again later."""
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 10.0


class BatchRunner:
    def __init__(
        self, store: BatchStore, forward: Forward, tenants: Tenants, *, concurrency: int = 8
    ) -> None:
        self.store = store
        self.forward = forward
        self.tenants = tenants
        self.concurrency = concurrency
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()

    def start(self, record: BatchRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._run(record), name=f"herd-batch-{record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))

    def resume(self) -> int:
        """Start every batch a previous process left unfinished; how many."""
        unfinished = [record for record in self.store.batches() if not record.is_finished]
        for record in unfinished:
            self.start(record)
        return len(unfinished)

    def cancel(self, record: BatchRecord) -> BatchRecord:
        """Stop starting lines; the lines in flight finish, then the batch is ``cancelled``."""
        if record.is_finished or record.status == "cancelling":
            return record
        self._cancelling.add(record.id)
        stopping = self.store.update_batch(record.id, record.tenant, cancelling)
        if record.id not in self._tasks:
            self.start(stopping)
        return stopping

    async def close(self) -> None:
        """Stop every batch where it is (``resume`` carries on from there)."""
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, record: BatchRecord) -> None:
        run = _Run(self, record)
        try:
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a defect: the batch fails, not the gateway, and no restart retries it
            log.exception("batch failed", extra={"batch": record.id})
            message = f"{INTERNAL_ERROR}; the answers written so far are in its output file"
            try:
                run.fail("internal_error", message)
            except Exception:  # the store itself is failing: the record stays as it was, logged
                log.exception("batch could not be marked failed", extra={"batch": record.id})


class _Run:
    """One batch from wherever it is to its end."""

    def __init__(self, runner: BatchRunner, record: BatchRecord) -> None:
        self.runner = runner
        self.store = runner.store
        self.record = record
        self.tenant: Tenant | None = None
        """The record's tenant as the keys define it now."""
        self.output: FileRecord | None = None
        self.errors: FileRecord | None = None
        self._unwritten: list[tuple[bytes, bool, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Run the batch's lines; cancelled (the gateway stopping), it still waits for the answers
        being written, so that the gateway after it finds every answer already sent on disk."""
        try:
            await self._run_lines()
        finally:
            if self._writer is not None:
                await asyncio.shield(self._writer)

    async def _run_lines(self) -> None:
        self.tenant = self.runner.tenants(self.record.tenant)
        if self.tenant is None:
            message = (
                f"the tenant {self.record.tenant!r} that created this batch has no API key any more; "
                "create the batch again with a current key"
            )
            self.fail("tenant_removed", message)
            return
        # Reading and parsing the input (up to max_batch_file_bytes) and the answers so far takes
        # seconds for a large batch: in a thread, so that interactive requests are not held up.
        prepared = await asyncio.to_thread(self._prepare)
        if prepared is None:
            return
        lines, done = prepared
        pending = [line for line in lines if line.custom_id not in done]
        limit = asyncio.Semaphore(self.runner.concurrency)
        async with asyncio.TaskGroup() as group:
            for line in pending:
                await limit.acquire()
                if self._is_stopping():
                    limit.release()
                    break
                task = group.create_task(self._one(line))
                task.add_done_callback(lambda _: limit.release())
        await asyncio.to_thread(self._finish, len(lines))

    def _prepare(self) -> tuple[list[BatchLine], set[str]] | None:
        """In a thread: the batch's lines and the ``custom_id`` already answered, its output and error
        files open and its counts saved; ``None`` when the input fails the batch."""
        lines = self._validated()
        if lines is None:
            return None
        self._open_files()
        answered, failed = self._answered()
        self._save(
            request_counts=RequestCounts(total=len(lines), completed=len(answered), failed=len(failed))
        )
        return lines, answered | failed

    def _validated(self) -> list[BatchLine] | None:
        tenant = self.record.tenant
        try:
            content = self.store.content(self.store.file(self.record.input_file_id, tenant))
            lines = parse_input(content, self.record.endpoint)
        except (HttpError, InputError) as error:
            line = error.line if isinstance(error, InputError) else None
            code = error.code if isinstance(error, InputError) else "invalid_input_file"
            self.fail(code, str(error), line=line)
            return None
        if self.record.status == "validating":
            self._save(status="in_progress", in_progress_at=int(time.time()))
        return lines

    def _open_files(self) -> None:
        tenant, batch_id = self.record.tenant, self.record.id
        if self.record.output_file_id is None:
            output = self.store.add_file(tenant, f"{batch_id}_output.jsonl", "batch_output", b"")
            errors = self.store.add_file(tenant, f"{batch_id}_error.jsonl", "batch_output", b"")
            self._save(output_file_id=output.id, error_file_id=errors.id)
        assert self.record.output_file_id is not None and self.record.error_file_id is not None
        self.output = self.store.truncate_partial(self.store.file(self.record.output_file_id, tenant))
        self.errors = self.store.truncate_partial(self.store.file(self.record.error_file_id, tenant))

    def _answered(self) -> tuple[set[str], set[str]]:
        """The ``custom_id`` of the output file's lines and of the error file's."""
        assert self.output is not None and self.errors is not None
        return done_ids(self.store.content(self.output)), done_ids(self.store.content(self.errors))

    def _is_stopping(self) -> bool:
        return self.record.id in self.runner._cancelling or self.record.status == "cancelling"

    async def _one(self, line: BatchLine) -> None:
        delay = RETRY_FIRST_S
        while True:
            if time.time() >= self.record.expires_at:
                message = "the batch expired before this request ran"
                await self._write(line, error_line(line.custom_id, None, None, message), ok=False)
                return
            answer = await self._send(line)
            if answer is None:
                return
            status, retry_after = answer
            if status not in RETRY_STATUSES or self._is_stopping():
                return
            delay = min(retry_after if retry_after is not None else delay * 2, RETRY_MAX_S)
            await asyncio.sleep(min(delay, max(0.0, self.record.expires_at - time.time())))

    async def _send(self, line: BatchLine) -> tuple[int, float | None] | None:
        """Send the line once and write its answer; a "not now" refusal is not written but returned as
        ``(status, its Retry-After)``, anything else gives ``None``."""
        try:
            assert self.tenant is not None
            response = await self.runner.forward(self.record.endpoint, line.body, _HEADERS, self.tenant)
        except HttpError as error:
            if error.status in RETRY_STATUSES:
                return error.status, _seconds(error.headers.get("Retry-After"))
            body = error.envelope().model_dump()
            await self._write(line, error_line(line.custom_id, error.status, body, error.message), ok=False)
            return None
        except Exception:  # this line fails alone; the batch goes on
            log.exception(
                "batch request failed", extra={"batch": self.record.id, "custom_id": line.custom_id}
            )
            message = "internal error while sending this request; see the orchestrator log"
            await self._write(line, error_line(line.custom_id, None, None, message), ok=False)
            return None
        status, body = response.status_code, _json(bytes(response.body))
        if status in RETRY_STATUSES:
            return status, _seconds(response.headers.get("retry-after"))
        request_id = response.headers.get("x-request-id")
        if status == 200:
            await self._write(line, output_line(line.custom_id, status, body, request_id), ok=True)
        else:
            await self._write(
                line, error_line(line.custom_id, status, body, f"the request was answered {status}"), ok=False
            )
        return None

    async def _write(self, line: BatchLine, text: bytes, *, ok: bool) -> None:
        """``text``, the answer to ``line``, on disk (in the output file when ``ok``, else the error
        file) with the batch's counts before this returns, written off the event loop together with
        the answers that arrive meanwhile."""
        written = asyncio.get_running_loop().create_future()
        self._unwritten.append((text, ok, written))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(
                self._write_waiting(), name=f"herd-batch-write-{self.record.id}"
            )
        await written

    async def _write_waiting(self) -> None:
        """Write what waits, one group at a time, until nothing does."""
        while self._unwritten:
            group, self._unwritten = self._unwritten, []
            try:
                await asyncio.to_thread(self._commit, [(text, ok) for text, ok, _ in group])
            except Exception as error:  # every line of the group fails as its write did
                for *_, written in group:
                    if not written.done():
                        written.set_exception(error)
            else:
                for *_, written in group:
                    if not written.done():
                        written.set_result(None)

    def _commit(self, group: list[tuple[bytes, bool]]) -> None:
        """Append the group's answers (one write and fsync a file) and save the counts; in a thread."""
        assert self.output is not None and self.errors is not None
        outputs = [text for text, ok in group if ok]
        errors = [text for text, ok in group if not ok]
        counts = self.record.request_counts
        if outputs:
            self.output = self.store.append(self.output, b"".join(outputs))
        if errors:
            self.errors = self.store.append(self.errors, b"".join(errors))
        update = {"completed": counts.completed + len(outputs), "failed": counts.failed + len(errors)}
        self._save(request_counts=counts.model_copy(update=update))

    def _finish(self, total: int) -> None:
        """End the batch as it stands: cancelled, expired or completed; in a thread."""
        now = int(time.time())
        answered, failed = self._answered()
        counts = RequestCounts(total=total, completed=len(answered), failed=len(failed))
        if self._is_stopping():
            self._save(status="cancelled", cancelled_at=now, request_counts=counts)
            self.runner._cancelling.discard(self.record.id)
        elif now >= self.record.expires_at:
            self._save(status="expired", expired_at=now, request_counts=counts)
        else:
            self._save(status="finalizing", finalizing_at=now, request_counts=counts)
            self._save(status="completed", completed_at=int(time.time()))
        if self.errors is not None and self.errors.bytes == 0:
            self.store.delete_file(self.errors)
            self._save(error_file_id=None)

    def fail(self, code: str, message: str, *, line: int | None = None) -> None:
        """End the batch ``failed``, saying why (OpenAI's ``errors`` list)."""
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]}
        self._save(status="failed", failed_at=int(time.time()), errors=errors)

    def _save(self, **changes: Any) -> None:
        """``changes`` on the stored record (which may run in the writer's thread: it touches only the
        store and ``self.record``). A stored ``cancelling`` stays, so ``_is_stopping`` sees it."""

        def change(stored: BatchRecord) -> BatchRecord:
            if stored.status == "cancelling" and changes.get("status") == "in_progress":
                changes.pop("status")
            return stored.model_copy(update=changes)

        self.record = self.store.update_batch(self.record.id, self.record.tenant, change)


def cancelling(record: BatchRecord) -> BatchRecord:
    """``record`` asked to stop: ``cancelling`` from now, unless it has finished or is already stopping."""
    if record.is_finished or record.status == "cancelling":
        return record
    return record.model_copy(update={"status": "cancelling", "cancelling_at": int(time.time())})


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode(errors="replace")


def _seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds; ``None`` when absent or not a number of seconds."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
