"""Watch streams: JSON lines of ADDED/MODIFIED/DELETED events, bounded in time.

Without a resourceVersion (or with ``0``, or with ``sendInitialEvents``) a watch starts with ADDED events
for what exists (then a BOOKMARK marking the end of them where asked); with one it replays the log after
it. A MODIFIED event that moves an object into or out of the selectors is sent as ADDED or DELETED, as a
real server does. The stream ends at ``timeoutSeconds`` (default 300 s), when the client goes away, or
when the emulator stops; the wait between checks is at most one second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kmock import KubernetesError

from ._events import StoreEvent
from ._resources import ResourceType
from ._selectors import Selector
from ._store import Store, is_selected

__all__ = ["DEFAULT_TIMEOUT_S", "WatchQuery", "watch_stream"]

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 1.0


@dataclass(frozen=True)
class WatchQuery:
    rtype: ResourceType
    namespace: str | None
    labels: Selector
    fields: Selector
    resource_version: int | None
    is_initial_bookmark_wanted: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def is_in_scope(self, obj: dict[str, Any]) -> bool:
        in_namespace = self.namespace is None or obj["metadata"].get("namespace") == self.namespace
        return in_namespace and is_selected(obj, self.labels, self.fields)


def _event(kind: str, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    shown = dict(obj, apiVersion=rtype.api_version, kind=rtype.kind)
    return {"type": kind, "object": shown}


def _translate(query: WatchQuery, event: StoreEvent) -> dict[str, Any] | None:
    if event.storage_key != query.rtype.storage_key:
        return None
    is_in = query.is_in_scope(event.obj)
    was_in = event.type == "MODIFIED" and event.previous is not None and query.is_in_scope(event.previous)
    if event.type != "MODIFIED":
        kind = event.type if is_in else None
    else:
        kind = "MODIFIED" if is_in and was_in else "ADDED" if is_in else "DELETED" if was_in else None
    return None if kind is None else _event(kind, query.rtype, event.obj)


def _bookmark(rtype: ResourceType, resource_version: int) -> dict[str, Any]:
    metadata = {
        "resourceVersion": str(resource_version),
        "annotations": {"k8s.io/initial-events-end": "true"},
    }
    return {
        "type": "BOOKMARK",
        "object": {"apiVersion": rtype.api_version, "kind": rtype.kind, "metadata": metadata},
    }


def _error(error: KubernetesError) -> dict[str, Any]:
    status = {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": error.status,
        "reason": error.reason,
        "message": error.message,
        "metadata": {},
    }
    return {"type": "ERROR", "object": status}


async def watch_stream(
    store: Store, query: WatchQuery, is_disconnected: Callable[[], bool]
) -> AsyncIterator[dict[str, Any]]:
    since = query.resource_version
    if since is None:
        since = store.resource_version
        for obj in store.select(query.rtype, query.namespace, query.labels, query.fields):
            yield {"type": "ADDED", "object": obj}
        if query.is_initial_bookmark_wanted:
            yield _bookmark(query.rtype, since)
    deadline = time.monotonic() + query.timeout_s
    while not store.log.is_closed and not is_disconnected() and time.monotonic() < deadline:
        changed = store.log.changed
        try:
            events = store.log.since(since)
        except KubernetesError as error:
            yield _error(error)
            return
        for event in events:
            if (item := _translate(query, event)) is not None:
                yield item
        since = events[-1].resource_version if events else since
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
