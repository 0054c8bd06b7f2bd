"""From a parsed request to a response: discovery documents, then the verbs on a resource."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import Any

import aiohttp.web
import kmock

from ._discovery import api_group, api_groups, api_resources, api_versions, server_version
from ._errors import bad_request, method_not_allowed, not_found, unsupported_media_type
from ._patches import PATCHERS, merge_patch
from ._paths import WATCH_TRUE, Route, parse_route
from ._resources import ResourceType
from ._scale import apply_scale, scale_of
from ._selectors import parse_field_selector, parse_label_selector
from ._store import Change, Store
from ._tables import is_table_wanted, table
from ._watch import DEFAULT_TIMEOUT_S, WatchQuery, watch_stream

__all__ = ["Router"]

Reply = tuple[int, dict[str, Any]]
Handler = Callable[[kmock.Request, Route, ResourceType], Reply]
_APPLY_PATCH = "application/apply-patch+yaml"
_STRATEGIC_PATCH = "application/strategic-merge-patch+json"


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


def _no_route(path: str) -> kmock.KubernetesError:
    return not_found("paths", path)


class Router:
    def __init__(self, store: Store, address: str) -> None:
        self.store = store
        self.address = address
        self._handlers: dict[tuple[str, bool], Handler] = {
            ("GET", False): self._list,
            ("POST", False): self._create,
            ("DELETE", False): self._delete_collection,
            ("GET", True): self._get,
            ("PUT", True): self._replace,
            ("PATCH", True): self._patch,
            ("DELETE", True): self._delete,
        }

    async def respond(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = "/" + request.url.path.strip("/")
        document = self._discover(path)
        if document is not None:
            return _json(document)
        route = parse_route(path)
        if route is None:
            raise _no_route(path)
        if route.plural is None:
            resources = api_resources(self.store.registry, route.group, route.version)
            if resources is None:
                raise _no_route(path)
            return _json(resources)
        rtype = self.store.registry.lookup(route.group, route.version, route.plural)
        if rtype is None or (route.namespace is not None and not rtype.is_namespaced):
            raise not_found("resources", f"{route.plural} in {route.group or 'core'}/{route.version}")
        if request.method == "GET" and request.params.get("watch") in WATCH_TRUE:
            return await self._watch(request, route, rtype)
        return self._serve(request, route, rtype)

    def _discover(self, path: str) -> dict[str, Any] | None:
        registry = self.store.registry
        if path == "/api":
            return api_versions(self.address)
        if path == "/apis":
            return api_groups(registry)
        if path == "/version":
            return server_version()
        if path == "/":
            groups = [
                f"/apis/{group}/{version}"
                for group, versions in registry.groups().items()
                if group
                for version in versions
            ]
            return {"paths": ["/api", "/api/v1", "/apis", "/version", *groups]}
        parts = path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "apis":
            return None
        versions = registry.groups().get(parts[1])
        if not versions:
            raise _no_route(path)
        return api_group(parts[1], versions)

    def _serve(self, request: kmock.Request, route: Route, rtype: ResourceType) -> aiohttp.web.Response:
        allowed = {None, "status" if rtype.has_status else None, "scale" if rtype.scale else None}
        if route.subresource not in allowed:
            raise not_found(f"{rtype.plural}/{route.subresource}", route.name or "")
        if "dryRun" in request.params:
            raise bad_request("dryRun is not supported by the test emulator: leave it out")
        handler = self._handlers.get((request.method, route.name is not None))
        if handler is None:
            raise method_not_allowed(f"{request.method} is not allowed on {request.url.path}")
        status, body = handler(request, route, rtype)
        if (
            is_table_wanted(request.headers.get("Accept", ""))
            and request.method == "GET"
            and not route.subresource
        ):
            body = self._table(request, rtype, body)
        return _json(body, status)

    def _table(self, request: kmock.Request, rtype: ResourceType, body: dict[str, Any]) -> dict[str, Any]:
        objs = body.get("items", [body])
        include = request.params.get("includeObject", "Metadata")
        return table(rtype, objs, str(self.store.resource_version), include)

    # Collections.

    def _list_doc(self, rtype: ResourceType, items: list[dict[str, Any]]) -> dict[str, Any]:
        metadata = {"resourceVersion": str(self.store.resource_version)}
        return {
            "apiVersion": rtype.api_version,
            "kind": f"{rtype.kind}List",
            "metadata": metadata,
            "items": items,
        }

    def _selected(self, request: kmock.Request, route: Route, rtype: ResourceType) -> list[dict[str, Any]]:
        labels = parse_label_selector(request.params.get("labelSelector"))
        fields = parse_field_selector(request.params.get("fieldSelector"))
        return self.store.select(rtype, route.namespace, labels, fields)

    def _list(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        return 200, self._list_doc(rtype, self._selected(request, route, rtype))

    def _create(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        return 201, self.store.create(rtype, route.namespace, request.data)

    def _delete_collection(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        deleted = [
            self.store.delete(
                rtype, obj["metadata"].get("namespace"), obj["metadata"]["name"], *_delete_options(request)
            )
            for obj in self._selected(request, route, rtype)
        ]
        return 200, self._list_doc(rtype, deleted)

    # Single objects.

    def _get(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        obj = self.store.get(rtype, route.namespace, str(route.name))
        return 200, scale_of(rtype, obj) if route.subresource == "scale" else obj

    def _update(self, route: Route, rtype: ResourceType, change: Change) -> Reply:
        name = str(route.name)
        if route.subresource != "scale":
            return 200, self.store.update(rtype, route.namespace, name, change, route.subresource)

        def scaled(obj: dict[str, Any]) -> dict[str, Any]:
            return apply_scale(rtype, obj, change(scale_of(rtype, obj)))

        return 200, scale_of(rtype, self.store.update(rtype, route.namespace, name, scaled, None))

    def _replace(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        body = copy.deepcopy(request.data)
        return self._update(route, rtype, lambda _: body)

    def _patch(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type == _APPLY_PATCH:
            return self._apply(request, route, rtype)
        patcher = PATCHERS.get(content_type)
        if rtype.schema is not None and content_type == _STRATEGIC_PATCH:
            raise unsupported_media_type(
                f"strategic merge patch is not supported for custom resources "
                f"({rtype.plural}.{rtype.group}): use application/merge-patch+json"
            )
        if patcher is None:
            raise unsupported_media_type(
                f"PATCH content type {content_type!r} is not supported: use one of "
                f"{', '.join([*PATCHERS, _APPLY_PATCH])}"
            )
        return self._update(route, rtype, lambda obj: patcher(obj, request.data))

    def _apply(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        """Server-side apply, simplified to a merge patch (no field ownership); creates what is missing."""
        with contextlib.suppress(kmock.KubernetesError):
            self.store.get(rtype, route.namespace, str(route.name))
            return self._update(route, rtype, lambda obj: merge_patch(obj, request.data))
        return self._create(request, route, rtype)

    def _delete(self, request: kmock.Request, route: Route, rtype: ResourceType) -> Reply:
        return 200, self.store.delete(rtype, route.namespace, str(route.name), *_delete_options(request))

    # Watches.

    async def _watch(
        self, request: kmock.Request, route: Route, rtype: ResourceType
    ) -> aiohttp.web.StreamResponse:
        query = _watch_query(request, route, rtype)
        raw = request._raw_request
        assert raw is not None, "requests reach the router from the HTTP server only"
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        with contextlib.suppress(ConnectionError):
            async for event in watch_stream(self.store, query, lambda: raw.transport is None):
                await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        return response


def _delete_options(request: kmock.Request) -> tuple[str, dict[str, Any]]:
    """Propagation policy (query or DeleteOptions body; ``orphanDependents`` too) and preconditions."""
    options = request.data if isinstance(request.data, dict) else {}
    policy = request.params.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
    return ("Orphan" if options.get("orphanDependents") is True else str(policy)), options.get(
        "preconditions", {}
    )


def _resource_version(text: str | None) -> int | None:
    if text in (None, "", "0"):
        return None
    try:
        return int(str(text))
    except ValueError:
        raise bad_request(
            f"resourceVersion {text!r} is not one this server issued: use one from a list"
        ) from None


def _seconds(text: str | None) -> float:
    try:
        return float(text or DEFAULT_TIMEOUT_S)
    except ValueError:
        raise bad_request(f"timeoutSeconds {text!r} is not a number of seconds") from None


def _watch_query(request: kmock.Request, route: Route, rtype: ResourceType) -> WatchQuery:
    params = request.params
    fields = ",".join(
        filter(None, [params.get("fieldSelector"), route.name and f"metadata.name={route.name}"])
    )
    is_initial = params.get("sendInitialEvents") == "true"
    return WatchQuery(
        rtype=rtype,
        namespace=route.namespace,
        labels=parse_label_selector(params.get("labelSelector")),
        fields=parse_field_selector(fields),
        resource_version=None if is_initial else _resource_version(params.get("resourceVersion")),
        is_initial_bookmark_wanted=is_initial,
        timeout_s=_seconds(params.get("timeoutSeconds")),
    )
