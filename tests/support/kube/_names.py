"""The API server's rules for object names and labels (422 Invalid when broken), and version priority."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ._errors import invalid

__all__ = ["check_labels", "check_name", "version_priority"]

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")

# Per plural, the name rule of its kind; everything else is a DNS-1123 subdomain.
_NAME_RULES = {"services": (_DNS1035_LABEL, 63), "namespaces": (_DNS1123_LABEL, 63)}


def check_name(plural: str, name: str) -> None:
    pattern, limit = _NAME_RULES.get(plural, (_DNS1123_SUBDOMAIN, 253))
    if len(name) > limit or not pattern.match(name):
        raise invalid(
            f'{plural} "{name}" is invalid: metadata.name: Invalid value: "{name}": must be lower-case '
            f"alphanumerics and '-' (starting with a letter for services), at most {limit} characters"
        )


def _check_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    prefix_ok = not prefix or (len(prefix) <= 253 and bool(_DNS1123_SUBDOMAIN.match(prefix)))
    return prefix_ok and len(name) <= 63 and bool(_LABEL_NAME.match(name))


def check_labels(labels: Mapping[str, object]) -> None:
    for key, value in labels.items():
        if not _check_label_key(key):
            raise invalid(
                f'metadata.labels: Invalid value: "{key}": a label key must be an optional DNS prefix '
                "and '/' plus a name of at most 63 alphanumerics, '-', '_' or '.'"
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            raise invalid(
                f'metadata.labels: Invalid value: "{value}": a label value must be at most 63 '
                "alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric"
            )


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key for Kubernetes versions: GA, then beta, then alpha, higher numbers first, others last."""
    match = _VERSION.match(version)
    if match is None:
        return (3, 0, 0, version)
    major, stage, minor = match.groups()
    return ({None: 0, "beta": 1, "alpha": 2}[stage], -int(major), -int(minor or 0), version)
