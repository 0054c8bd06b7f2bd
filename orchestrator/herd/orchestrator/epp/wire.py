"""The Endpoint Picker protocol's messages over Envoy's ext_proc, as pure functions.

The protocol (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):

- request: the data plane MAY restrict the choice to a subset of endpoints in the filter metadata
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``, or one
  comma-separated string); an empty or unmatched subset is a 503;
- the picker names its choice both in the ``x-gateway-destination-endpoint`` request header and in
  the dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the same ``ip:port``);
- it answers 503 through an ``ImmediateResponse`` when no endpoint is ready, 429 when it sheds load;
- response: the data plane reports the endpoint that served in the metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint-served``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from herd.api.errors import HttpError

__all__ = [
    "DESTINATION_HEADER",
    "DESTINATION_NAMESPACE",
    "MAX_CHUNK_BYTES",
    "SERVED_KEY",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "address_of",
    "body_chunks",
    "continue_body",
    "continue_headers",
    "destination",
    "header_map",
    "immediate",
    "served_endpoint",
    "subset_hint",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MAX_CHUNK_BYTES = 62_000
"""A streamed body is answered in chunks below the 64 KiB some Envoy builds accept per message."""

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def address_of(url: str) -> str:
    """A worker's ``ip:port`` (its URL's authority), as the data plane names endpoints."""
    return urlsplit(url).netloc


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """The request's headers by lower-case name (Envoy sends ``raw_value``; older builds ``value``);
    a repeated header keeps its last value."""
    return {
        entry.key.lower(): entry.raw_value.decode(errors="replace") if entry.raw_value else entry.value
        for entry in headers.headers.headers
    }


def _entry(metadata: Metadata, namespace: str, key: str) -> object:
    if namespace not in metadata.filter_metadata:
        return None
    return MessageToDict(metadata.filter_metadata[namespace]).get(key)


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The endpoints the data plane allows (``None``: no hint, every endpoint of the pool)."""
    value = _entry(metadata, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    parts = value if isinstance(value, list) else [value]
    return frozenset(address.strip() for part in parts for address in str(part).split(",") if address.strip())


def served_endpoint(metadata: Metadata) -> str | None:
    """The endpoint the data plane reports as the one that served, if it reports one."""
    value = _entry(metadata, DESTINATION_NAMESPACE, SERVED_KEY)
    return value.split(",")[0].strip() if isinstance(value, str) and value.strip() else None


def _set_headers(headers: Mapping[str, str]) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)
            for key, value in headers.items()
        ]
    )


def destination(address: str, *, in_body: bool) -> ProcessingResponse:
    """The choice: the destination header (overwriting any the client sent) and the ``envoy.lb``
    metadata, on the request-headers answer, or on the request-body answer when the body was buffered
    (Envoy then still holds the headers). The route cache is cleared so routes may match the header."""
    common = CommonResponse(
        header_mutation=_set_headers({DESTINATION_HEADER: address}), clear_route_cache=True
    )
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: address}})
    if in_body:
        return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=metadata)
    return ProcessingResponse(request_headers=HeadersResponse(response=common), dynamic_metadata=metadata)


def continue_headers(*, is_request: bool, set_headers: Mapping[str, str] | None = None) -> ProcessingResponse:
    """Let the headers pass (with ``set_headers`` added)."""
    common = CommonResponse(header_mutation=_set_headers(set_headers)) if set_headers else CommonResponse()
    if is_request:
        return ProcessingResponse(request_headers=HeadersResponse(response=common))
    return ProcessingResponse(response_headers=HeadersResponse(response=common))


def continue_body(*, is_request: bool) -> ProcessingResponse:
    """Let a body chunk (streamed or buffered mode) pass unchanged."""
    body = BodyResponse(response=CommonResponse())
    if is_request:
        return ProcessingResponse(request_body=body)
    return ProcessingResponse(response_body=body)


def body_chunks(body: bytes, *, is_request: bool, end_of_stream: bool) -> list[ProcessingResponse]:
    """``body`` handed back in full-duplex streamed mode, where Envoy forwards only what the picker
    sends: chunks of at most ``MAX_CHUNK_BYTES``, the last one ending the stream if ``end_of_stream``."""
    pieces = [body[start : start + MAX_CHUNK_BYTES] for start in range(0, len(body), MAX_CHUNK_BYTES)] or [
        b""
    ]
    responses = []
    for number, piece in enumerate(pieces, start=1):
        streamed = StreamedBodyResponse(body=piece, end_of_stream=end_of_stream and number == len(pieces))
        body_response = BodyResponse(
            response=CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))
        )
        if is_request:
            responses.append(ProcessingResponse(request_body=body_response))
        else:
            responses.append(ProcessingResponse(response_body=body_response))
    return responses


def immediate(error: HttpError) -> ProcessingResponse:
    """Answer the client at once with ``error`` in the OpenAI envelope (404, 400, 429, 503, ...)."""
    body = json.dumps(error.envelope().model_dump()).encode()
    headers = _set_headers({"content-type": "application/json", **error.headers})
    answer = ImmediateResponse(status=HttpStatus(code=error.status), headers=headers, body=body)
    return ProcessingResponse(immediate_response=answer)
