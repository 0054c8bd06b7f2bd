"""What the client has of a resumable stream, so that another worker can go on from exactly there.

A worker that answers with ``RESUMABLE_HEADER`` closes the SSE events of each engine output with a
mark (``herd.api.resume``): the choice, the output token ids, whether it finished. ``StreamLedger``
reads the stream event by event: it holds the events back until their mark comes, then releases them
to the client and records the mark's tokens, and drops the marks themselves. So what the client has
seen always corresponds to whole marks, and ``resume_params`` tells a new worker exactly the tokens
behind it: the new worker sends neither a token twice nor skips one. Events after the last mark (the
usage chunk, ``[DONE]``) are released when the answer ends complete (``flush``); if the worker dies
before, they are dropped, and the new worker sends them again.
"""

from __future__ import annotations

import json

from herd.api.resume import MARK_PREFIX, ResumeChoice, ResumeParams, parse_mark

__all__ = ["StreamLedger"]

_SEPARATOR = b"\n\n"
_DATA = b"data: {"


class StreamLedger:
    """Reads one resumable stream (``feed`` each chunk, ``flush`` at its end); pure, no I/O."""

    def __init__(self) -> None:
        self._carry = b""
        self._held: list[bytes] = []
        self._tokens: dict[int, list[int]] = {}
        self._finished: set[int] = set()
        self.created: int | None = None
        """The stream's ``created``, read from the first event the client got."""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` (with what earlier chunks left) the client may have now."""
        *events, self._carry = (self._carry + chunk).split(_SEPARATOR)
        released: list[bytes] = []
        for event in events:
            if event.startswith(MARK_PREFIX):
                found = parse_mark(event)
                if found is not None:
                    self._tokens.setdefault(found.index, []).extend(found.token_ids)
                    if found.is_finished:
                        self._finished.add(found.index)
                    released += self._held
                    self._held.clear()
            elif event:
                self._held.append(event + _SEPARATOR)
        return self._released(released)

    def flush(self) -> bytes:
        """The answer ended complete: everything still held."""
        released, self._held = self._held, []
        if self._carry:
            released.append(self._carry)
            self._carry = b""
        return self._released(released)

    def resume_params(self) -> ResumeParams:
        """Where the client stands: each choice's tokens sent and whether it finished."""
        indexes = sorted(self._tokens.keys() | self._finished)
        choices = [
            ResumeChoice(
                index=index, token_ids=self._tokens.get(index, []), is_finished=index in self._finished
            )
            for index in indexes
        ]
        return ResumeParams(created=self.created, choices=choices)

    @property
    def num_tokens(self) -> int:
        """Output tokens the client has, over every choice."""
        return sum(len(tokens) for tokens in self._tokens.values())

    def _released(self, events: list[bytes]) -> bytes:
        if self.created is None:
            self.created = next(filter(None, (_created(event) for event in events)), None)
        return b"".join(events)


def _created(event: bytes) -> int | None:
    if not event.startswith(_DATA):
        return None
    try:
        created = json.loads(event[len(b"data: ") :]).get("created")
    except (ValueError, AttributeError):
        return None
    return created if isinstance(created, int) else None
