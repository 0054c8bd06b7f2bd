"""A Kubernetes API emulator for tests, built on kmock (see ``emulator.py`` and ``_store.py``).

kopf, the ``kubernetes`` client and ``kubectl --validate=false`` run against it. It stores objects with
the API server's semantics (server-set metadata, optimistic locking, finalizers, garbage collection,
selectors, watches, patches, status and scale subresources, CRDs) and runs no controllers.
"""

from __future__ import annotations

from ._errors import ApiError
from ._resources import ResourceType
from ._store import Store
from .emulator import Emulator, kube_emulator

__all__ = ["ApiError", "Emulator", "ResourceType", "Store", "kube_emulator"]
