"""With API keys on, every route but the probes' needs a key (checked over the route table, so a new
route cannot slip by), and no API key or internal token ever reaches a log line."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from starlette.routing import Route
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.orchestrator.app import AppSettings
from herd.orchestrator.auth import OPEN_PATHS, ApiKeys
from herd.orchestrator.lora_admin import ADMIN_PATHS
from herd.orchestrator.registry import RegistrySettings

KEY = "sk-herd-key-7f3a9c"
TOKEN = "herd-internal-token-5e1b2d"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
SETTINGS = AppSettings(internal_token=TOKEN, registry=RegistrySettings(poll_interval=0.02))


def routes(app: FastAPI) -> list[tuple[str, str]]:
    return sorted(
        (path, method)
        for route in app.routes
        if isinstance(route, Route)
        for path in [route.path]
        for method in route.methods or ()
        if method != "HEAD"
    )


async def test_every_route_but_the_probes_needs_a_key() -> None:
    async with running_gateway(FakeCluster([FakeWorker("w0")]), api_keys=ApiKeys([KEY])) as (app, client):
        table = routes(app)
        without = {(path, method): (await client.request(method, path)).status_code for path, method in table}
        with_key = {
            (path, method): (await client.request(method, path, headers={"authorization": f"Bearer {KEY}"}))
            for path, method in table
        }
        unknown = await client.get("/v2/anything")
    assert {path for path, _ in table} >= {"/v1/models", "/dashboard", "/dashboard/data", "/openapi.json"}
    assert {route: status for route, status in without.items() if route[0] in OPEN_PATHS} == {
        ("/health", "GET"): 200,
        ("/ready", "GET"): 200,
        ("/metrics", "GET"): 200,
    }
    refused = {route: status for route, status in without.items() if route[0] not in OPEN_PATHS | ADMIN_PATHS}
    assert refused and set(refused.values()) == {401}
    assert all(
        response.status_code != 401 for route, response in with_key.items() if route[0] not in ADMIN_PATHS
    )
    # The admin routes take admin keys only, and there are none here.
    assert {status for route, status in without.items() if route[0] in ADMIN_PATHS} == {403}
    assert unknown.status_code == 401 and unknown.headers["www-authenticate"] == "Bearer"
    assert unknown.json()["error"]["type"] == "authentication_error"


async def test_no_key_or_internal_token_reaches_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1", is_dropping=True)])
    wrong_key = KEY + "-wrong"
    with caplog.at_level(logging.DEBUG):
        async with running_gateway(cluster, settings=SETTINGS, api_keys=ApiKeys([KEY])) as (_, client):
            good = {"authorization": f"Bearer {KEY}"}
            for _ in range(4):  # both workers, the dropping one included (retried, ejected, logged)
                await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=good)
            await client.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {wrong_key}"}
            )
            await client.post("/v1/chat/completions", json={"model": MODEL}, headers=good)
            await client.get("/dashboard/data", headers=good)
    lines = [record.getMessage() + repr(record.__dict__) for record in caplog.records]
    assert len(lines) > 5  # the run did log: requests, polls, an ejection
    assert not [line for line in lines if KEY in line or TOKEN in line]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (
            "kv_transfer_params",
            {"peer_url": "http://127.0.0.1:9/elsewhere"},
        ),  # would be dialled with the token
        ("kv_transfer_params", {"do_remote_prefill": True, "remote_block_ids": [1]}),
        ("herd_resume", {"choices": [{"index": 0, "token_ids": [1, 2, 3]}]}),  # would be streamed as output
    ],
    ids=["peer-pull", "remote-prefill", "resumed-output"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_clients_internal_field_is_refused_before_any_worker_sees_it(
    path: str, field: str, value: dict[str, object]
) -> None:
    worker = FakeWorker("w0")
    body = CHAT if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "hi"}
    async with running_gateway(FakeCluster([worker]), settings=SETTINGS) as (_, client):
        response = await client.post(path, json={**body, field: value})
        plain = await client.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert "a client may not send it" in response.json()["error"]["message"]
    assert plain.status_code == 200 and [sorted(sent) for sent in worker.bodies] == [sorted(body)]
