"""In-memory objects with the API server's write semantics.

Every write is validated, stamped with server metadata and the next global resourceVersion, and logged
for watches. Deletion honours finalizers (deletionTimestamp first, removal once the last finalizer goes)
and ends with a synchronous garbage collection: dependents whose every owner is gone are deleted at once
(background propagation; ``Orphan`` strips the owner reference instead; ``Foreground`` behaves as
background). Deleting a namespace deletes what is in it; deleting a CRD removes its objects and
its types. Not thread-safe: the emulator calls it from its event loop only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import already_exists, bad_request, conflict, invalid, not_found
from ._events import EventLog, StoreEvent
from ._meta import carry_server_fields, is_spec_changed, new_name, now, stamp_new
from ._names import check_labels, check_name
from ._resources import CRD_GROUP, Registry, ResourceType, types_from_crd
from ._schema import apply_schema
from ._selectors import Selector

__all__ = ["Change", "Store"]

Change = Callable[[dict[str, Any]], dict[str, Any]]
ObjectKey = tuple[str, str]  # (namespace or "", name)
NAMESPACES = ("", "namespaces")
SEED_NAMESPACES = ("default", "kube-system", "kube-public")


class Store:
    def __init__(self) -> None:
        self.registry = Registry()
        self.log = EventLog()
        self.resource_version = 0
        self._objects: dict[tuple[str, str], dict[ObjectKey, dict[str, Any]]] = {}
        self._types: dict[tuple[str, str], ResourceType] = {}
        self._uids: dict[str, tuple[tuple[str, str], ObjectKey]] = {}
        namespaces = self.registry.resolve("namespaces")
        for name in SEED_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})

    # Reading: copies out, served at the requested version.

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        return _present(rtype, self._find(rtype, namespace, name))

    def select(
        self, rtype: ResourceType, namespace: str | None, labels: Selector, fields: Selector
    ) -> list[dict[str, Any]]:
        bucket = self._objects.get(rtype.storage_key, {})
        return [
            _present(rtype, obj)
            for key, obj in sorted(bucket.items())
            if (namespace is None or key[0] == namespace) and is_selected(obj, labels, fields)
        ]

    # Writing.

    def create(self, rtype: ResourceType, namespace: str | None, body: Any) -> dict[str, Any]:
        obj = self._prepare_new(rtype, namespace, body)
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if key in self._objects.get(rtype.storage_key, {}):
            raise already_exists(rtype.plural, key[1])
        self._check_namespace_exists(rtype, key[0])
        stamp_new(obj, rtype, self.resource_version + 1)
        obj = _conform(rtype, obj)
        self._on_crd_written(rtype, obj)
        self._write(rtype, key, obj, None)
        return _present(rtype, obj)

    def update(
        self, rtype: ResourceType, namespace: str | None, name: str, change: Change, subresource: str | None
    ) -> dict[str, Any]:
        """Apply ``change`` to a copy of the object: the body of a PUT, or a patch."""
        old = self._find(rtype, namespace, name)
        new = change(copy.deepcopy(old))
        _check_identity(rtype, new, old)
        _check_precondition(rtype, new, old)
        _check_finalizers(new, old)
        check_labels(new["metadata"].get("labels") or {})
        new = _restrict_to_subresource(rtype, new, old, subresource)
        carry_server_fields(new, old)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = _conform(rtype, new)
        if new == old:
            return _present(rtype, old)  # a no-op write keeps its resourceVersion, as on a real server
        if is_spec_changed(new, old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._on_crd_written(rtype, new)
        self._write(rtype, (old["metadata"].get("namespace", ""), name), new, old)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(rtype, new, "Background")
        return _present(rtype, new)

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        propagation: str = "Background",
        preconditions: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Delete now, or mark for deletion while finalizers remain; ``preconditions`` (uid, resourceVersion)
        must match the object, as in DeleteOptions."""
        obj = self._find(rtype, namespace, name)
        _check_delete_preconditions(rtype, obj, preconditions or {})
        if not obj["metadata"].get("finalizers"):
            return _present(rtype, self._remove(rtype, obj, propagation))
        if obj["metadata"].get("deletionTimestamp"):
            return _present(rtype, obj)
        marked = copy.deepcopy(obj)
        marked["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
        self._write(rtype, (obj["metadata"].get("namespace", ""), name), marked, obj)
        return _present(rtype, marked)

    # Internals.

    def _find(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        key = ((namespace or "") if rtype.is_namespaced else "", name)
        obj = self._objects.get(rtype.storage_key, {}).get(key)
        if obj is None:
            raise not_found(rtype.plural, name)
        return obj

    def _prepare_new(self, rtype: ResourceType, namespace: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request(f"the body of a {rtype.kind} must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        name = new_name(meta)
        if name is None:
            raise invalid(f"{rtype.kind}: metadata.name or metadata.generateName is required")
        meta["name"] = name
        check_name(rtype.plural, name)
        check_labels(meta.get("labels") or {})
        if not rtype.is_namespaced:
            meta.pop("namespace", None)
        elif namespace and meta.setdefault("namespace", namespace) != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace of the URL")
        elif not meta.get("namespace"):
            meta["namespace"] = "default"
        return obj

    def _check_namespace_exists(self, rtype: ResourceType, namespace: str) -> None:
        if rtype.is_namespaced and ("", namespace) not in self._objects.get(NAMESPACES, {}):
            raise not_found("namespaces", namespace)

    def _write(
        self, rtype: ResourceType, key: ObjectKey, obj: dict[str, Any], previous: dict[str, Any] | None
    ) -> None:
        self.resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        self._objects.setdefault(rtype.storage_key, {})[key] = obj
        self._types[rtype.storage_key] = rtype
        self._uids[obj["metadata"]["uid"]] = (rtype.storage_key, key)
        kind = "ADDED" if previous is None else "MODIFIED"
        self.log.append(StoreEvent(self.resource_version, kind, rtype.storage_key, obj, previous))

    def _remove(self, rtype: ResourceType, obj: dict[str, Any], propagation: str) -> dict[str, Any]:
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        del self._objects[rtype.storage_key][key]
        del self._uids[obj["metadata"]["uid"]]
        self.resource_version += 1
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self.resource_version)
        self.log.append(StoreEvent(self.resource_version, "DELETED", rtype.storage_key, gone, obj))
        self._after_removal(rtype, gone, propagation)
        return gone

    def _after_removal(self, rtype: ResourceType, obj: dict[str, Any], propagation: str) -> None:
        if rtype.storage_key == NAMESPACES:
            self._delete_where(lambda key, _: key[0] == obj["metadata"]["name"], "Background")
        elif rtype.storage_key == (CRD_GROUP, "customresourcedefinitions"):
            self._drop_crd(obj)
        self._collect_garbage(obj["metadata"]["uid"], propagation)

    def _collect_garbage(self, owner_uid: str, propagation: str) -> None:
        def is_dependent(_: ObjectKey, dependent: dict[str, Any]) -> bool:
            refs = dependent["metadata"].get("ownerReferences", ())
            return any(ref.get("uid") == owner_uid for ref in refs)

        if propagation == "Orphan":
            self._orphan_where(is_dependent, owner_uid)
        else:
            self._delete_where(
                lambda key, dep: is_dependent(key, dep) and not self._has_live_owner(dep), propagation
            )

    def _has_live_owner(self, obj: dict[str, Any]) -> bool:
        return any(ref.get("uid") in self._uids for ref in obj["metadata"].get("ownerReferences", ()))

    def _matching(
        self, predicate: Callable[[ObjectKey, dict[str, Any]], bool]
    ) -> list[tuple[ResourceType, str]]:
        return [
            (self._types[storage_key], obj["metadata"]["uid"])
            for storage_key, bucket in self._objects.items()
            for key, obj in bucket.items()
            if predicate(key, obj)
        ]

    def _delete_where(self, predicate: Callable[[ObjectKey, dict[str, Any]], bool], propagation: str) -> None:
        for rtype, uid in self._matching(predicate):
            if uid in self._uids:  # an earlier cascade in this loop may have removed it already
                _, (namespace, name) = self._uids[uid]
                self.delete(rtype, namespace, name, propagation)

    def _orphan_where(self, predicate: Callable[[ObjectKey, dict[str, Any]], bool], owner_uid: str) -> None:
        def strip(obj: dict[str, Any]) -> dict[str, Any]:
            refs = obj["metadata"].get("ownerReferences", [])
            obj["metadata"]["ownerReferences"] = [ref for ref in refs if ref.get("uid") != owner_uid]
            return obj

        for rtype, uid in self._matching(predicate):
            _, (namespace, name) = self._uids[uid]
            self.update(rtype, namespace, name, strip, None)

    def _on_crd_written(self, rtype: ResourceType, crd: dict[str, Any]) -> None:
        if rtype.storage_key != (CRD_GROUP, "customresourcedefinitions"):
            return
        spec, name = crd.get("spec", {}), crd["metadata"]["name"]
        plural, group = spec.get("names", {}).get("plural"), spec.get("group")
        if not plural or not group or not spec.get("names", {}).get("kind") or name != f"{plural}.{group}":
            raise invalid(
                f"CRD {name!r}: spec.group, spec.names.plural and kind are required, name = plural.group"
            )
        self.registry.set_crd(name, types_from_crd(crd))

    def _drop_crd(self, crd: dict[str, Any]) -> None:
        types = self.registry.drop_crd(crd["metadata"]["name"])
        for storage_key in {rtype.storage_key for rtype in types}:
            for obj in list(self._objects.get(storage_key, {}).values()):
                self._remove(self._types[storage_key], obj, "Background")


def is_selected(obj: dict[str, Any], labels: Selector, fields: Selector) -> bool:
    return labels.matches(obj["metadata"].get("labels", {})) and fields.matches(obj)


def _conform(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    """Custom resources go through their CRD's schema: defaults, pruning, validation."""
    return obj if rtype.schema is None else apply_schema(obj, rtype.schema, f"{rtype.kind}.{rtype.group}")


def _present(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    shown = copy.deepcopy(obj)
    shown.update(apiVersion=rtype.api_version, kind=rtype.kind)
    return shown


def _check_identity(rtype: ResourceType, new: Any, old: dict[str, Any]) -> None:
    if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
        raise bad_request(f"the body of a {rtype.kind} must be a JSON object with object metadata")
    meta = new.setdefault("metadata", {})
    for field in ("name", "namespace"):
        if meta.setdefault(field, old["metadata"].get(field)) != old["metadata"].get(field):
            raise bad_request(f"metadata.{field} cannot change: it must match the object in the URL")


def _check_precondition(rtype: ResourceType, new: dict[str, Any], old: dict[str, Any]) -> None:
    """A resourceVersion in the body is an optimistic lock: it must still be the current one."""
    wanted = new["metadata"].get("resourceVersion")
    if wanted is not None and str(wanted) != old["metadata"]["resourceVersion"]:
        why = "the object has been modified; please apply your changes to the latest version and try again"
        raise conflict(rtype.plural, old["metadata"]["name"], why)


def _check_finalizers(new: dict[str, Any], old: dict[str, Any]) -> None:
    if not old["metadata"].get("deletionTimestamp"):
        return
    added = set(new["metadata"].get("finalizers") or ()) - set(old["metadata"].get("finalizers") or ())
    if added:
        raise invalid(
            f"metadata.finalizers: Forbidden: no new finalizers can be added if the object is being "
            f"deleted, found new finalizers {sorted(added)}"
        )


def _check_delete_preconditions(
    rtype: ResourceType, obj: dict[str, Any], preconditions: Mapping[str, Any]
) -> None:
    for field in ("uid", "resourceVersion"):
        wanted, actual = preconditions.get(field), obj["metadata"][field]
        if wanted is not None and wanted != actual:
            why = f"Precondition failed: {field} in precondition: {wanted}, {field} in object meta: {actual}"
            raise conflict(rtype.plural, obj["metadata"]["name"], why)


def _restrict_to_subresource(
    rtype: ResourceType, new: dict[str, Any], old: dict[str, Any], subresource: str | None
) -> dict[str, Any]:
    """Writes to the main resource keep the old status; writes to /status change only the status."""
    if subresource == "status":
        result = copy.deepcopy(old)
        result.pop("status", None)
        if "status" in new:
            result["status"] = new["status"]
        return result
    if rtype.has_status:
        new.pop("status", None)
        if "status" in old:
            new["status"] = copy.deepcopy(old["status"])
    return new
