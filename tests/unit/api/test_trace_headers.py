"""herd.api.tracing: which of a client's trace headers a next hop is sent."""

from __future__ import annotations

import pytest

from herd.api.tracing import client_trace_headers

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("headers", "passed_on"),
    [
        ({"traceparent": PARENT, "tracestate": "a=1"}, {"traceparent": PARENT, "tracestate": "a=1"}),
        ({"traceparent": PARENT, "x-other": "y"}, {"traceparent": PARENT}),
        ({"traceparent": "00-\xff", "tracestate": "a=\xe9"}, {}),  # bytes a header line cannot carry
        ({"tracestate": "a=1\x07"}, {}),
        ({}, {}),
    ],
    ids=["both", "only-trace-headers", "not-ascii", "control-character", "none"],
)
def test_only_printable_ascii_trace_headers_are_passed_on(
    headers: dict[str, str], passed_on: dict[str, str]
) -> None:
    assert client_trace_headers(headers) == passed_on
