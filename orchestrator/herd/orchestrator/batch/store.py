"""Files and batches on a directory (a volume on Kubernetes), so that they outlive the gateway.

Layout: ``files/<id>.json`` (the file's record) beside ``files/<id>.data`` (its bytes), and
``batches/<id>.json`` (the batch's record). Records are replaced atomically (a temporary file
renamed over the old one); output and error lines are appended and flushed to disk one by one, so
after a crash a file ends in whole lines, at most one cut short (``lines.done_ids`` ignores it and
``truncate_partial`` drops it before lines are appended again). Every record names its tenant (the
name only: its rights are the keys file's of the moment, not those it had when the record was made),
and a tenant sees only its own files and batches (another's are 404, as if they did not exist).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from herd.api.errors import HttpError

__all__ = ["BatchRecord", "BatchStatus", "BatchStore", "FileRecord", "RequestCounts"]

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINISHED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
_HIDDEN = {"tenant"}
R = TypeVar("R", bound="_Record")
log = logging.getLogger(__name__)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str
    """The tenant's name."""

    @field_validator("tenant", mode="before")
    @classmethod
    def _tenant_name(cls, value: Any) -> Any:
        # Records written before names alone were kept hold the whole tenant: only its name counts.
        return value.get("name") if isinstance(value, dict) else value

    def public(self) -> dict[str, Any]:
        """What the API answers: everything but the tenant."""
        return self.model_dump(exclude=_HIDDEN)


class FileRecord(_Record):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchRecord(_Record):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED


class BatchStore:
    """Its methods may run on the event loop or in a worker thread (the runner writes answers off
    the loop); ``update_batch`` is the read-change-write of a batch record that both may do at once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._batch_lock = threading.Lock()
        self._warned: set[Path] = set()
        """Damaged records already logged, so that each is logged once, not on every listing."""
        for folder in ("files", "batches"):
            (root / folder).mkdir(parents=True, exist_ok=True)

    # files

    def add_file(self, tenant: str, filename: str, purpose: str, content: bytes) -> FileRecord:
        record = FileRecord(
            tenant=tenant,
            id=f"file-{secrets.token_hex(12)}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        _write_atomically(self._data(record.id), content)
        self._save(self._file_path(record.id), record)
        return record

    def file(self, file_id: str, tenant: str) -> FileRecord:
        return self._load(self._file_path(file_id), FileRecord, tenant, f"no file {file_id!r}", "file_id")

    def content(self, record: FileRecord) -> bytes:
        return self._data(record.id).read_bytes()

    def files(self, tenant: str, purpose: str | None = None) -> list[FileRecord]:
        found = [record for record in self._all("files", FileRecord) if record.tenant == tenant]
        return sorted(
            (record for record in found if purpose is None or record.purpose == purpose),
            key=lambda record: (record.created_at, record.id),
            reverse=True,
        )

    def delete_file(self, record: FileRecord) -> None:
        self._file_path(record.id).unlink(missing_ok=True)
        self._data(record.id).unlink(missing_ok=True)

    def append(self, record: FileRecord, line: bytes) -> FileRecord:
        """Append whole lines (one or more), on disk before this returns; the record with its new size."""
        with self._data(record.id).open("ab") as data:
            data.write(line)
            data.flush()
            os.fsync(data.fileno())
        grown = record.model_copy(update={"bytes": record.bytes + len(line)})
        self._save(self._file_path(record.id), grown)
        return grown

    def truncate_partial(self, record: FileRecord) -> FileRecord:
        """Drop a last line cut short by a crash; the record with the size that remains."""
        path = self._data(record.id)
        content = path.read_bytes()
        whole = content[: content.rfind(b"\n") + 1]
        if len(whole) != len(content):
            with path.open("r+b") as data:
                data.truncate(len(whole))
        if record.bytes == len(whole):
            return record
        fixed = record.model_copy(update={"bytes": len(whole)})
        self._save(self._file_path(record.id), fixed)
        return fixed

    # batches

    def add_batch(self, record: BatchRecord) -> None:
        """Store a new batch; ``FileExistsError`` when its id is taken (a record is never overwritten
        by another batch's)."""
        path = self._batch_path(record.id)
        with self._batch_lock:
            if path.exists():
                raise FileExistsError(f"batch {record.id!r} exists already")
            self._save(path, record)

    def save_batch(self, record: BatchRecord) -> None:
        with self._batch_lock:
            self._save(self._batch_path(record.id), record)

    def update_batch(
        self, batch_id: str, tenant: str, change: Callable[[BatchRecord], BatchRecord]
    ) -> BatchRecord:
        """The stored record through ``change``, saved and returned; no other ``update_batch`` or
        ``save_batch`` comes between the read and the write (a thread's and the loop's)."""
        with self._batch_lock:
            record = change(self.batch(batch_id, tenant))
            self._save(self._batch_path(record.id), record)
            return record

    def batch(self, batch_id: str, tenant: str) -> BatchRecord:
        return self._load(
            self._batch_path(batch_id), BatchRecord, tenant, f"no batch {batch_id!r}", "batch_id"
        )

    def batches(self, tenant: str | None = None) -> list[BatchRecord]:
        """Newest first; every tenant's when ``tenant`` is None (the runner resuming after a restart)."""
        found = [
            record
            for record in self._all("batches", BatchRecord)
            if tenant is None or record.tenant == tenant
        ]
        return sorted(found, key=lambda record: (record.created_at, record.id), reverse=True)

    def unfinished_batch_using(self, record: FileRecord) -> BatchRecord | None:
        """A batch of the file's tenant, not finished, that reads or writes the file."""
        return next(
            (
                batch
                for batch in self.batches(record.tenant)
                if not batch.is_finished
                and record.id in (batch.input_file_id, batch.output_file_id, batch.error_file_id)
            ),
            None,
        )

    # records

    def _batch_path(self, batch_id: str) -> Path:
        return self.root / "batches" / f"{_safe(batch_id)}.json"

    def _file_path(self, file_id: str) -> Path:
        return self.root / "files" / f"{_safe(file_id)}.json"

    def _data(self, file_id: str) -> Path:
        return self.root / "files" / f"{_safe(file_id)}.data"

    def _save(self, path: Path, record: _Record) -> None:
        _write_atomically(path, record.model_dump_json().encode())

    def _load(self, path: Path, kind: type[R], tenant: str, missing: str, param: str) -> R:
        try:
            record = kind.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            raise HttpError(
                404, f"{missing}; list yours with GET /v1/{path.parent.name}", param=param
            ) from None
        if record.tenant != tenant:
            raise HttpError(404, f"{missing}; list yours with GET /v1/{path.parent.name}", param=param)
        return record

    def _all(self, folder: str, kind: type[R]) -> Iterator[R]:
        for path in (self.root / folder).glob("*.json"):
            try:
                yield kind.model_validate_json(path.read_bytes())
            except OSError:
                continue  # deleted since the listing
            except ValueError as error:  # records are replaced whole, so this one was damaged
                if path not in self._warned:
                    self._warned.add(path)
                    log.warning("skipping %s, a record that does not parse: %s", path, error)


def _safe(identifier: str) -> str:
    """An id as a file name: ids are ours (``file-<hex>``), anything else cannot name a file."""
    if not identifier.replace("-", "").replace("_", "").isalnum():
        return "invalid"
    return identifier


def _write_atomically(path: Path, content: bytes) -> None:
    """``content`` at ``path``, whole or not at all; each write has a temporary file of its own, so
    writers of one path (a gateway's thread and its loop, or a gateway stopping and its successor)
    never rename each other's."""
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
    with temporary.open("wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)
