"""The operator's log as a user reads it: one concise JSON line per event (``herd.api.logs``).

kopf attaches its whole ``OperatorSettings`` and a Kubernetes object reference to every record it
logs, and says "succeeded" after every handler call and startup activity; httpx logs every request
the operator makes. ``ConciseRecords`` keeps what a user acts on: the reference becomes
``object: Kind namespace/name``, the settings and kopf's posting flag go, kopf's per-call successes
and activity chatter go, and httpx speaks only of failures.
"""

from __future__ import annotations

import logging
import re

__all__ = ["ConciseRecords", "configure_operator_logs", "object_ref"]

_CHATTER = re.compile(
    r"^(Handler|Activity) '[^']*' succeeded\.$"
    r"|^Initial authentication has (been initiated|finished)\.$"
    r"|^\w+ is processed: \d+ succeeded; 0 failed\.$"
)
_KOPF_EXTRAS = ("settings", "k8s_skip", "k8s_ref")


def object_ref(kind: str, namespace: str | None, name: str) -> str:
    """``ModelDeployment models/smollm2``: how a log line names the object it is about."""
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


class ConciseRecords(logging.Filter):
    """Drops kopf's chatter below warnings and trims kopf's extras to an ``object`` field."""

    def filter(self, record: logging.LogRecord) -> bool:
        is_quiet = record.name.startswith("kopf") and record.levelno < logging.WARNING
        if is_quiet and _CHATTER.match(record.getMessage()):
            return False
        ref = record.__dict__.get("k8s_ref")
        for key in _KOPF_EXTRAS:
            record.__dict__.pop(key, None)
        if isinstance(ref, dict) and "object" not in record.__dict__:
            record.__dict__["object"] = object_ref(
                str(ref.get("kind")), ref.get("namespace"), str(ref.get("name"))
            )
        return True


def configure_operator_logs() -> None:
    """Install ``ConciseRecords`` on the root handlers (``herd.api.logs.configure_logging`` made
    them) and keep httpx's per-request lines out."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(ConciseRecords())
    logging.getLogger("httpx").setLevel(logging.WARNING)
