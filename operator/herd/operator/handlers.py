"""kopf handlers: thin, typed, each one call into the shared level-based reconcile.

* create / update / resume of a ModelDeployment: one pass, done once the children are written; an
  invalid spec is a ``PermanentError``, an API error a ``TemporaryError``. Pods that are not ready yet
  are not a failure: their events bring the status along (below). Failing the handler until they were
  ready kept kopf's last-handled spec behind the children, so a scale up and back before the pods were
  ready read as no change at all and left the Deployment at the larger count.
* events of owned Deployments, Services and Pods (by herd's labels): a pass for the owner, so status
  follows pods and manual edits are reverted at once. Events of the operator's own writes are
  skipped. No timer: kopf timers need a finalizer, and a watch that breaks is re-listed by kopf,
  which replays every child as an event.
* autoscaling: one operator-wide task (``autoscaler.py``), started and stopped with the operator,
  not a kopf timer, which would add a finalizer; it writes ``spec.replicas`` like ``kubectl scale``.
* deletion: every child carries an owner reference (``kopf.adopt``), so the garbage collector
  removes them; herd adds no finalizer and no delete handler, so a stopped operator never blocks a
  ``kubectl delete`` and there is nothing to clean up by hand.
kopf's own bookkeeping lives in annotations (``operator.herd.dev/...``), never in ``status``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from herd.api.crd import GROUP, PLURAL, VERSION
from herd.api.protocol import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGED_BY
from herd.kube import load_connection
from herd.operator.autoscaler import Autoscaler
from herd.operator.kube import KubeApi, KubeError, kopf_login
from herd.operator.reconcile import ChildConflictError, Reconciler
from herd.operator.settings import OperatorConfig

__all__ = ["ANNOTATION_PREFIX", "registry"]

ANNOTATION_PREFIX = "operator.herd.dev"
_log = logging.getLogger("herd.operator")
registry = kopf.OperatorRegistry()
_MD = (GROUP, VERSION, PLURAL)
_OWNED = {LABEL_MANAGED_BY: MANAGED_BY}


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.config
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    connection = load_connection(config.kubeconfig)
    api = KubeApi(connection.http_client())
    memo.reconciler = Reconciler(api, config.plan)
    memo.autoscaler = Autoscaler(api, config.autoscaler, memo.get("namespaces", ()), plan=config.plan)
    memo.autoscaler.start()
    namespaces = memo.get("namespaces") or ["every namespace"]
    _log.info(f"operator started: serving {', '.join(namespaces)}")


@kopf.on.login(registry=registry)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    config: OperatorConfig = memo.config
    return kopf_login(load_connection(config.kubeconfig))


@kopf.on.cleanup(registry=registry)
async def close(memo: kopf.Memo, **_: Any) -> None:
    if "autoscaler" in memo:
        await memo.autoscaler.stop()
    if "reconciler" in memo:
        await memo.reconciler.api.http.aclose()


@kopf.on.resume(*_MD, registry=registry)
@kopf.on.create(*_MD, registry=registry)
@kopf.on.update(*_MD, registry=registry)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    try:
        await memo.reconciler.reconcile(_raw(body))
    except (KubeError, ChildConflictError) as error:  # the next pass starts from fresh reads
        raise kopf.TemporaryError(str(error), delay=memo.config.retry_delay) from error


@kopf.on.event("apps/v1", "deployments", labels=_OWNED, registry=registry)
@kopf.on.event("v1", "services", labels=_OWNED, registry=registry)
@kopf.on.event("v1", "pods", labels=_OWNED, registry=registry)
async def child_changed(
    body: kopf.Body,
    labels: kopf.Labels,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    owner = labels.get(LABEL_DEPLOYMENT)
    if owner and namespace and not memo.reconciler.is_own_write(str(body.get("kind", "")), body.metadata):
        await memo.reconciler.poke(namespace, owner)


def _raw(body: kopf.Body) -> dict[str, Any]:
    return copy.deepcopy(dict(body))
