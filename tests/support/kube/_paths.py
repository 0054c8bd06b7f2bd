"""Request parsing: the API path grammar, and the kmock ``Request`` record every request becomes.

kmock 0.8's own parser fails on ``/api/v1/namespaces`` and reads ``/api/v1/namespaces/NAME`` as a
namespace scope, so paths are parsed here and the result is stored in kmock's ``Request`` fields
(``resource``, ``namespace``, ``name``, ``subresource``, ``action``) for kmock-style assertions.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock
import yaml

from ._errors import bad_request, unsupported_media_type

__all__ = ["WATCH_TRUE", "Route", "parse_request", "parse_route"]

WATCH_TRUE = ("true", "1", "True")  # the python client sends True, kubectl and kopf send true
_NAMESPACE_SUBRESOURCES = ("status", "finalize")


@dataclass(frozen=True)
class Route:
    group: str
    version: str
    namespace: str | None = None
    plural: str | None = None
    name: str | None = None
    subresource: str | None = None


def _split_scope(rest: list[str]) -> tuple[str | None, list[str]]:
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in _NAMESPACE_SUBRESOURCES:
        return rest[1], rest[2:]
    return None, rest


def parse_route(path: str) -> Route | None:
    """``/api/V/...`` and ``/apis/G/V/...`` paths; None for anything else (discovery roots included)."""
    parts = [urllib.parse.unquote(part) for part in path.strip("/").split("/") if part]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace, rest = _split_scope(rest)
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return Route(group, version, namespace, plural, name, subresource)


def _action(method: str, route: Route | None, params: dict[str, str]) -> kmock.action | None:
    if route is None or route.plural is None:
        return None
    if method == "GET" and params.get("watch") in WATCH_TRUE:
        return kmock.action.WATCH
    verbs = (
        {"GET": kmock.action.LIST, "POST": kmock.action.CREATE}
        if route.name is None
        else {
            "GET": kmock.action.FETCH,
            "PUT": kmock.action.UPDATE,
            "PATCH": kmock.action.UPDATE,
            "DELETE": kmock.action.DELETE,
        }
    )
    return verbs.get(method)


def _decode(text: str, content_type: str) -> Any:
    if not text:
        return None
    if "protobuf" in content_type or "cbor" in content_type:
        raise unsupported_media_type(f"{content_type} is not supported by the test emulator: send JSON")
    try:
        return yaml.safe_load(text) if content_type.endswith("yaml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as error:
        raise bad_request(f"the request body is not valid {content_type}: {error}") from None


async def parse_request(raw: aiohttp.web.BaseRequest, index: int) -> kmock.Request:
    text = await raw.text()
    params = dict(raw.query)
    route = parse_route(raw.path)
    resource = (
        None
        if route is None
        else kmock.resource(group=route.group, version=route.version, plural=route.plural)
    )
    return kmock.Request(
        id=index,
        raw_request=raw,
        url=raw.url,
        method=raw.method,
        params=params,
        headers=dict(raw.headers),
        cookies=dict(raw.cookies),
        body=text.encode(),
        text=text,
        data=_decode(text, raw.content_type),
        action=_action(raw.method, route, params),
        resource=resource,
        namespace=route.namespace if route else None,
        name=route.name if route else None,
        subresource=route.subresource if route else None,
    )
