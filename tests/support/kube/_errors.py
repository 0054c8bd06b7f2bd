"""Kubernetes ``Status`` failures, raised by the store and rendered by kmock's Status renderer."""

from __future__ import annotations

from kmock import KubernetesError

__all__ = [
    "ApiError",
    "already_exists",
    "bad_request",
    "conflict",
    "gone",
    "invalid",
    "method_not_allowed",
    "not_found",
    "unsupported_media_type",
]

ApiError = KubernetesError


def _error(status: int, reason: str, message: str, **details: str) -> KubernetesError:
    return KubernetesError(status=status, reason=reason, message=message, details=details)


def not_found(plural: str, name: str) -> KubernetesError:
    return _error(404, "NotFound", f'{plural} "{name}" not found', kind=plural, name=name)


def already_exists(plural: str, name: str) -> KubernetesError:
    return _error(409, "AlreadyExists", f'{plural} "{name}" already exists', kind=plural, name=name)


def conflict(plural: str, name: str, why: str) -> KubernetesError:
    message = f'Operation cannot be fulfilled on {plural} "{name}": {why}'
    return _error(409, "Conflict", message, kind=plural, name=name)


def invalid(message: str) -> KubernetesError:
    """422: the request is well-formed but cannot be applied (kopf retries JSON patches on this)."""
    return _error(422, "Invalid", message)


def bad_request(message: str) -> KubernetesError:
    return _error(400, "BadRequest", message)


def method_not_allowed(message: str) -> KubernetesError:
    return _error(405, "MethodNotAllowed", message)


def gone(message: str) -> KubernetesError:
    return _error(410, "Expired", message)


def unsupported_media_type(message: str) -> KubernetesError:
    return _error(415, "UnsupportedMediaType", message)
