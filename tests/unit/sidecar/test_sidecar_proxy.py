"""The sidecar's public port over a vLLM answered by ``httpx.MockTransport``: what reaches vLLM, what
comes back, and the OpenAI envelope on every error."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from herd.api.protocol import TOKEN_HEADER
from herd.api.resume import RESUMABLE_HEADER, RESUME_FIELD
from herd.sidecar._proxy import build_public_app

VLLM = "http://127.0.0.1:1"


class _VLLM:
    """Records what reached vLLM and answers with ``status`` and ``body``."""

    def __init__(self, status: int = 200, body: bytes = b'{"ok": true}', *, is_up: bool = True) -> None:
        self.status, self.body, self.is_up = status, body, is_up
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.is_up:
            raise httpx.ConnectError("connection refused", request=request)
        self.requests.append(request)
        self.bodies.append(request.content)
        if request.url.path == "/health":
            return httpx.Response(200)
        # A stream, as from a socket: a response built from bytes counts as read already.
        headers = {"content-type": "application/json"}
        return httpx.Response(self.status, headers=headers, stream=httpx.ByteStream(self.body))


async def _client(vllm: _VLLM, *, is_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    upstream = httpx.AsyncClient(base_url=VLLM, transport=httpx.MockTransport(vllm))
    app = build_public_app(upstream, lambda: is_ready)
    async with (
        upstream,
        httpx.AsyncClient(base_url="http://sidecar", transport=httpx.ASGITransport(app)) as client,
    ):
        yield client


@pytest.fixture
def vllm() -> _VLLM:
    return _VLLM()


@pytest.fixture
async def client(vllm: _VLLM) -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client(vllm):
        yield client


async def test_herd_only_fields_and_the_token_do_not_reach_vllm_and_the_trace_does(
    vllm: _VLLM, client: httpx.AsyncClient
) -> None:
    body = {"model": "m", "messages": [], "kv_transfer_params": {"prompt_token_ids": [1]}}
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = {TOKEN_HEADER: "secret", "X-Request-Id": "r-1", "traceparent": traceparent}
    response = await client.post("/v1/chat/completions?x=1", json=body, headers=headers)
    assert response.status_code == 200 and response.json() == {"ok": True}
    sent = vllm.requests[-1]
    assert (sent.url.path, sent.url.query) == ("/v1/chat/completions", b"x=1")
    assert json.loads(vllm.bodies[-1]) == {"model": "m", "messages": []}
    assert TOKEN_HEADER.lower() not in sent.headers and sent.headers["x-request-id"] == "r-1"
    assert sent.headers["traceparent"] == traceparent  # vLLM's own tracing joins the gateway's trace


async def test_a_stream_is_never_resumable_and_a_continuation_is_refused(
    vllm: _VLLM, client: httpx.AsyncClient
) -> None:
    """vLLM cannot go on exactly from tokens it did not sample (seeded generator, penalties, grammar,
    stop strings): the sidecar asks for no marks, so herd's gateway never resumes a vLLM stream, and
    refuses a continuation outright."""
    headers = {TOKEN_HEADER: "secret", RESUMABLE_HEADER: "1"}
    body = {"model": "m", "messages": [], "stream": True}
    answered = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert answered.status_code == 200 and RESUMABLE_HEADER.lower() not in answered.headers
    assert RESUMABLE_HEADER.lower() not in vllm.requests[-1].headers
    num_sent = len(vllm.requests)
    resume = {"created": 1, "choices": [{"index": 0, "token_ids": [5, 6]}]}
    refused = await client.post("/v1/chat/completions", json={**body, RESUME_FIELD: resume}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == RESUME_FIELD
    assert "cannot resume a stream" in refused.json()["error"]["message"]
    assert len(vllm.requests) == num_sent


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"kv_transfer_params": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "more than 64 levels"),
        (b'{"kv_transfer_params": {', "not valid JSON"),
    ],
    ids=["past-python-s-recursion-limit", "not-json"],
)
async def test_a_body_with_a_herd_field_that_cannot_be_read_is_refused(
    vllm: _VLLM, client: httpx.AsyncClient, raw: bytes, words: str
) -> None:
    response = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and words in response.json()["error"]["message"]
    assert vllm.bodies == []


async def test_a_body_without_herd_fields_goes_as_sent(vllm: _VLLM, client: httpx.AsyncClient) -> None:
    raw = b'{"model":"m",  "prompt":"kv"}'
    await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert vllm.bodies[-1] == raw


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        pytest.param(
            404,
            b'{"detail":"Not Found"}',
            "vLLM answered 404: there is no route POST /v1/x",
            id="fastapi-detail",
        ),
        pytest.param(
            500, b"Internal Server Error", "vLLM answered 500: Internal Server Error", id="plain-text"
        ),
    ],
)
async def test_errors_outside_the_envelope_are_wrapped(status: int, body: bytes, message: str) -> None:
    async for client in _client(_VLLM(status, body)):
        response = await client.post("/v1/x", json={})
        assert response.status_code == status
        assert response.json()["error"]["message"].startswith(message)
        assert response.json()["error"]["code"] == status


async def test_vllms_own_envelope_passes_as_is() -> None:
    envelope = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}'
    async for client in _client(_VLLM(404, envelope)):
        assert (await client.post("/v1/chat/completions", json={})).content == envelope


async def test_vllm_unreachable_is_a_503_with_retry_after() -> None:
    async for client in _client(_VLLM(is_up=False)):
        for path in ("/v1/models", "/health", "/ready"):
            response = await client.get(path)
            assert response.status_code == 503 and response.headers["retry-after"] == "1", path
            assert "vLLM server at http://127.0.0.1:1" in response.json()["error"]["message"]


async def test_ready_only_once_the_sidecar_is(vllm: _VLLM) -> None:
    async for client in _client(vllm, is_ready=False):
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).status_code == 200
    async for client in _client(vllm, is_ready=True):
        assert (await client.get("/ready")).status_code == 200
