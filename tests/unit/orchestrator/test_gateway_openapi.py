"""GET /openapi.json describes the four OpenAI routes with request bodies from the wire models and
the error envelope for their errors, in a form an API fuzzer (schemathesis) loads."""

from __future__ import annotations

from typing import Any

import schemathesis
from support.gateway_fakes import FakeCluster, FakeWorker, running_gateway

from herd.orchestrator.auth import ApiKeys

ROUTES = {
    ("/v1/chat/completions", "post"),
    ("/v1/completions", "post"),
    ("/v1/embeddings", "post"),
    ("/v1/models", "get"),
}


async def document(**kwargs: Any) -> dict[str, Any]:
    async with running_gateway(FakeCluster([FakeWorker("w0")]), **kwargs) as (_, client):
        headers = {"authorization": "Bearer k"} if "api_keys" in kwargs else {}
        response = await client.get("/openapi.json", headers=headers)
        assert (await client.get("/docs", headers=headers)).status_code == 404
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def test_the_document_has_the_four_routes_with_bodies_and_errors() -> None:
    doc = await document()
    assert {(path, method) for path, methods in doc["paths"].items() for method in methods} == ROUTES
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage", "TextPart", "ErrorResponse"} <= set(
        schemas
    )
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "input" in schemas["EmbeddingRequest"]["required"]
    error = chat["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"400", "401", "404", "413", "429", "500", "503"} <= set(chat["responses"])
    assert "security" not in doc


async def test_a_fuzzer_loads_it_and_it_names_the_key_when_keys_are_on() -> None:
    doc = await document(api_keys=ApiKeys(["k"]))
    assert doc["security"] == [{"apiKey": []}]
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(operation.path, operation.method) for operation in operations} == ROUTES
