"""The one level-based reconcile pass shared by create, update, resume and child events.

A pass reads the ModelDeployment as it is now, plans the desired children, compares each with the
server's copy (create when missing, replace when the spec hash or an owned field differs, else
leave it alone), observes the pools' pods, and writes the status once if it changed. Running it
twice changes nothing; so a restarted operator, a missed event or a manual edit all converge.
Passes for one resource never overlap (a lock per resource), and child events that arrive while a
pass is queued fold into it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, cast

import kopf
from pydantic import ValidationError

from herd.api.crd import API_VERSION, KIND, PLURAL, ModelDeployment
from herd.api.manifest import format_validation_error
from herd.api.protocol import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGED_BY
from herd.operator.conditions import Reason
from herd.operator.drift import is_drifted, replacement
from herd.operator.events import announce_transitions
from herd.operator.kube import KubeApi, KubeError
from herd.operator.logs import object_ref
from herd.operator.plan import ANNOTATION_SPEC_HASH, DesiredObject, plan, selector_string
from herd.operator.settings import PlanSettings
from herd.operator.status import blocked_status, plan_status

__all__ = ["Change", "ChildConflictError", "Reconciler"]

Object = dict[str, Any]
Change = Literal["created", "updated", "reverted", "unchanged"]
_log = logging.getLogger("herd.operator")


class ChildConflictError(RuntimeError):
    """A child's name is taken by an object that this ModelDeployment does not own; herd leaves it alone."""


class Reconciler:
    """Operator-wide reconcile state: the API client, the plan settings and per-resource locks."""

    def __init__(self, api: KubeApi, settings: PlanSettings) -> None:
        self.api = api
        self.settings = settings
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._queued: set[tuple[str, str]] = set()
        self._written: dict[tuple[str, str, str], str] = {}

    async def reconcile(self, body: Object) -> None:
        """One pass for the resource ``body`` names; raises ``kopf.PermanentError`` naming the field if
        the spec is invalid.

        The pass acts on the resource as it is now, read under the lock, not on ``body``: kopf may hand
        over a body that a newer change has overtaken (a resume queued behind an update), and acting
        on it would roll the children back to the older spec.
        """
        meta = body["metadata"]
        async with self._lock(meta["namespace"], meta["name"]):
            latest = await self.api.get(API_VERSION, PLURAL, meta["namespace"], meta["name"])
            if latest is None:  # deleted meanwhile: its children go with it
                return
            await self._pass(latest)

    async def poke(self, namespace: str, name: str) -> None:
        """Run a pass for a resource whose child changed; passes already queued for it absorb this one."""
        key = (namespace, name)
        if key in self._queued:
            return
        self._queued.add(key)
        async with self._lock(namespace, name):
            self._queued.discard(key)
            body = await self.api.get(API_VERSION, PLURAL, namespace, name)
            if body is not None:
                try:
                    await self._pass(body)
                except kopf.PermanentError:
                    pass  # An invalid spec is already reported in the status and as an event.
                except (KubeError, ChildConflictError) as error:
                    _log.warning(
                        f"{error}; the next event of its children retries the pass",
                        extra={"object": object_ref(KIND, namespace, name)},
                    )

    def is_own_write(self, kind: str, meta: Mapping[str, Any]) -> bool:
        """Whether a child's watch event is the echo of this operator's own last write of it."""
        version = self._written.get((kind, meta.get("namespace", ""), meta.get("name", "")))
        return version is not None and version == meta.get("resourceVersion")

    def _remember(self, written: Object | None) -> Object | None:
        if written is not None:
            meta = written.get("metadata", {})
            key = (written.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))
            self._written[key] = meta.get("resourceVersion", "")
        return written

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def _pass(self, body: Object) -> None:
        md = await self._parse(body)
        about = {"object": object_ref(KIND, md.metadata.namespace, md.metadata.name)}
        desired = plan(md, self.settings)
        children = [copy.deepcopy(obj) for obj in desired.objects]
        owner = _as_kopf_body(body)
        kopf.adopt([obj.body for obj in children], owner=owner)
        applied = await self._apply_all(children, body, owner)
        done = [f"{obj.kind}/{obj.name} {change}" for obj, change, _ in applied if change != "unchanged"]
        (_log.info if done else _log.debug)(
            f"plan {desired.summary()}: {', '.join(done) or 'no change'}", extra=about
        )
        deployments = [
            current
            for obj, _, current in applied
            if obj.kind == "Deployment" and obj.component == "pool" and current
        ]
        pods = await self.api.list("v1", "pods", md.metadata.namespace, _owned_by(md.metadata.name))
        previous = body.get("status") or {}
        status = plan_status(md, desired, (pods, deployments), previous, now=_now(), settings=self.settings)
        await self._write_status(body, status)
        if (pools := _pools(status)) != _pools(previous):
            is_short = any(_is_short(pool, desired.replicas[name]) for name, pool in status["pools"].items())
            _log.info(f"waiting for ready pods: {pools}" if is_short else f"ready: {pools}", extra=about)

    async def _parse(self, body: Object) -> ModelDeployment:
        try:
            return ModelDeployment.from_object(body)
        except ValidationError as error:
            message = format_validation_error(error)
            await self._block(body, Reason.INVALID_SPEC, message)
            meta = body["metadata"]
            raise kopf.PermanentError(
                f"invalid ModelDeployment {meta['namespace']}/{meta['name']}: {message}"
            ) from None

    async def _apply_all(
        self, children: list[DesiredObject], body: Object, owner: kopf.Body
    ) -> list[tuple[DesiredObject, Change, Object | None]]:
        try:
            return [(obj, *await self._apply(obj, owner)) for obj in children]
        except ChildConflictError as error:
            await self._block(body, Reason.CHILD_CONFLICT, str(error))
            raise

    async def _block(self, body: Object, reason: str, message: str) -> None:
        """Ready=False with ``reason``: herd cannot act on this spec until something changes."""
        generation = body["metadata"].get("generation")
        status = blocked_status(generation, reason, message, body.get("status") or {}, now=_now())
        await self._write_status(body, status)

    async def _apply(self, obj: DesiredObject, owner: kopf.Body) -> tuple[Change, Object | None]:
        """Create or replace ``obj`` as needed; returns what changed and the child as it now is."""
        namespace = obj.body["metadata"]["namespace"]
        observed = await self.api.get(obj.api_version, obj.plural, namespace, obj.name)
        if observed is None:
            created = self._remember(await self.api.create(obj.api_version, obj.plural, obj.body))
            kopf.info(owner, reason="Created", message=f"created {obj.kind}/{obj.name}")
            return "created", created
        if not _is_ours(observed, owner):
            raise ChildConflictError(
                f"{obj.kind}/{obj.name} already exists and is not owned by this ModelDeployment: "
                "delete or rename that object, or rename the ModelDeployment"
            )
        if not is_drifted(observed, obj.body):
            return "unchanged", observed
        replaced = self._remember(
            await self.api.replace(obj.api_version, obj.plural, replacement(observed, obj.body))
        )
        if observed["metadata"].get("annotations", {}).get(ANNOTATION_SPEC_HASH) == obj.spec_hash:
            kopf.warn(
                owner, reason="DriftReverted", message=f"reverted manual edits of {obj.kind}/{obj.name}"
            )
            return "reverted", replaced
        kopf.info(owner, reason="Updated", message=f"updated {obj.kind}/{obj.name} to the current spec")
        return "updated", replaced

    async def _write_status(self, body: Object, status: Object) -> None:
        previous = body.get("status") or {}
        if all(previous.get(key) == value for key, value in status.items()):
            return
        removed_pools = {
            name: None for name in previous.get("pools") or {} if name not in status.get("pools", {})
        }
        patch = {**status, "pools": {**removed_pools, **status["pools"]}} if "pools" in status else status
        meta = body["metadata"]
        await self.api.patch_status(API_VERSION, PLURAL, meta["namespace"], meta["name"], patch)
        announce_transitions(_as_kopf_body(body), previous.get("conditions") or [], status["conditions"])


def _as_kopf_body(body: Object) -> kopf.Body:
    return kopf.Body(cast("kopf.RawBody", body))


def _is_ours(child: Object, owner: kopf.Body) -> bool:
    """Owned by ``owner``, or an orphan carrying its labels (left by an orphaning delete): adopt it."""
    meta = child.get("metadata", {})
    refs = meta.get("ownerReferences") or []
    if any(ref.get("uid") == owner.metadata.uid for ref in refs):
        return True
    labels = meta.get("labels") or {}
    is_labelled = (
        labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_DEPLOYMENT) == owner.metadata.name
    )
    return is_labelled and not any(ref.get("controller") for ref in refs)


def _owned_by(md_name: str) -> str:
    return selector_string({LABEL_MANAGED_BY: MANAGED_BY, LABEL_DEPLOYMENT: md_name})


def _is_short(pool: Object, desired: int) -> bool:
    return int(pool["readyReplicas"]) < desired


def _pools(status: Object) -> str:
    """``workers 2/3``: each pool's ready/desired, as the log line of a change names them."""
    return ", ".join(f"{name} {pool['ready']}" for name, pool in (status.get("pools") or {}).items())


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
