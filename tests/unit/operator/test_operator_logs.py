"""The operator's log lines: kopf's chatter and extras trimmed, one concise JSON object per event."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from herd.api.logs import JsonFormatter
from herd.operator.logs import ConciseRecords

REF = {"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "name": "chat", "uid": "u1",
       "namespace": "models"}  # fmt: skip
KOPF_EXTRAS = {"settings": object(), "k8s_skip": False, "k8s_ref": REF}


def record(name: str, level: int, msg: str, **extra: Any) -> logging.LogRecord:
    made = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    made.__dict__.update(extra)
    return made


@pytest.mark.parametrize(
    ("name", "level", "msg"),
    [
        ("kopf.objects", logging.INFO, "Handler 'child_changed' succeeded."),
        ("kopf.objects", logging.INFO, "Handler 'reconcile/spec' succeeded."),
        ("kopf.activities.startup", logging.INFO, "Activity 'configure' succeeded."),
        ("kopf._core.engines.activities", logging.INFO, "Initial authentication has been initiated."),
        ("kopf._core.engines.activities", logging.INFO, "Initial authentication has finished."),
        ("kopf.objects", logging.INFO, "Updating is processed: 1 succeeded; 0 failed."),
    ],
    ids=["event-handler", "sub-handler", "activity", "auth-start", "auth-end", "cause-summary"],
)
def test_kopf_chatter_is_dropped(name: str, level: int, msg: str) -> None:
    assert not ConciseRecords().filter(record(name, level, msg, **KOPF_EXTRAS))


@pytest.mark.parametrize(
    ("name", "level", "msg"),
    [
        ("kopf.objects", logging.ERROR, "Handler 'reconcile' failed temporarily: API answered 500"),
        ("kopf.objects", logging.INFO, "Resuming is processed: 0 succeeded; 1 failed."),
        ("kopf.objects", logging.WARNING, "Handler 'reconcile' succeeded."),
        ("herd.operator", logging.INFO, "Handler 'x' succeeded."),
    ],
    ids=["failure", "failed-summary", "warning-level", "not-kopf"],
)
def test_what_a_user_acts_on_is_kept(name: str, level: int, msg: str) -> None:
    assert ConciseRecords().filter(record(name, level, msg, **KOPF_EXTRAS))


def test_a_kept_kopf_record_is_one_short_json_line_naming_its_object() -> None:
    kept = record("kopf.objects", logging.ERROR, "Handler 'reconcile' failed temporarily", **KOPF_EXTRAS)
    assert ConciseRecords().filter(kept)
    line = JsonFormatter("operator").format(kept)
    entry = json.loads(line)
    assert entry["object"] == "ModelDeployment models/chat"
    assert not {"settings", "k8s_skip", "k8s_ref"} & set(entry)
    assert "\n" not in line and len(line) < 300


def test_herds_own_object_field_wins_over_kopfs_reference() -> None:
    own = record(
        "kopf.objects", logging.INFO, "ready: workers 2/2", object="ModelDeployment a/b", **KOPF_EXTRAS
    )
    assert ConciseRecords().filter(own)
    assert own.__dict__["object"] == "ModelDeployment a/b"
