"""A Kubernetes API emulator for tests, built on kmock (see ``emulator.py`` and ``_store.py``).

kopf, the ``kubernetes`` client and ``kubectl --validate=false`` run against it. It stores objects with
the API server's semantics (server-set metadata, optimistic locking, finalizers, garbage collection,
selectors, watches, patches, status and scale subresources, CRDs and their schemas) and runs no
controllers. README.md beside this file lists what is and is not emulated.

Layout: ``emulator`` (thread, kubeconfig, helpers) -> ``_handler`` (kmock) -> ``_router`` (HTTP verbs)
-> ``_store`` (write semantics, GC) with ``_events``/``_watch`` (change log, streams), ``_meta``,
``_schema``, ``_patches``, ``_selectors``, ``_scale``, ``_resources``, ``_discovery``, ``_paths``.
"""

from __future__ import annotations

from ._errors import ApiError
from ._resources import ResourceType
from ._store import Store
from .emulator import Emulator, kube_emulator

__all__ = ["ApiError", "Emulator", "ResourceType", "Store", "kube_emulator"]
