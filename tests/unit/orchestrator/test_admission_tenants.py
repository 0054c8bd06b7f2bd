"""Tenants: the keys file's tenants, their models and priorities, through the gateway."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.errors import HttpError
from herd.orchestrator.admission.tenants import (
    ANONYMOUS,
    DEFAULT_TENANT,
    LOWEST_PRIORITY,
    Quotas,
    Tenant,
    effective_priority,
    parse_tenants,
)
from herd.orchestrator.auth import ApiKeys, load_api_keys

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TENANTS = """
tenants:
  - name: search
    keys: [sk-search-1, sk-search-2]
    priority: 1
    weight: 2
    models: [tiny]
    quotas: {requestsPerMinute: 60, tokensPerMinute: 1000}
  - name: batch-team
    keys: [sk-batch]
    priority: 5
    models: [other]
"""


def test_a_tenants_file_maps_each_key_to_its_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(TENANTS)
    keys = load_api_keys(path)
    search = keys.tenant("Bearer sk-search-2")
    assert search is not None and search.name == "search" and search.weight == 2.0
    assert search.quotas == Quotas(requests_per_minute=60, tokens_per_minute=1000)
    assert search.models == ("tiny",) and search.may_use("tiny") and not search.may_use("other")
    assert keys.tenant("Bearer sk-batch") == Tenant(name="batch-team", priority=5, models=("other",))
    assert keys.tenant("Bearer sk-nope") is None
    assert "sk-search" not in repr(search)


def test_a_plain_keys_file_is_the_default_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# one per line\nk1\nk2\n")
    tenant = load_api_keys(path).tenant("Bearer k2")
    assert tenant is not None and tenant.name == "default" and tenant.priority == 0


def test_without_keys_every_request_is_anonymous() -> None:
    assert ApiKeys([]).tenant(None) is ANONYMOUS


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("tenants: []", "tenants"),
        ("tenants: [{name: a}]", "tenants.0.keys"),
        ("tenants: [{name: a, keys: [k], priority: -1}]", "tenants.0.priority"),
        ("tenants: [{name: a, keys: [k], weight: 0}]", "tenants.0.weight"),
        ("tenants: [{name: A B, keys: [k]}]", "tenants.0.name"),
        ("tenants: [{name: a, keys: [k], quotas: {rpm: 3}}]", "tenants.0.quotas.rpm"),
        ("tenants: [{name: a, keys: [k]}, {name: a, keys: [j]}]", "unique"),
        ("tenants: [{name: a, keys: [k]}, {name: b, keys: [k]}]", "one tenant"),
    ],
    ids=[
        "empty",
        "no-keys",
        "negative-priority",
        "zero-weight",
        "bad-name",
        "unknown-key",
        "same-name",
        "same-key",
    ],
)
def test_an_invalid_tenants_file_names_the_field(document: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        parse_tenants(document, source="keys.yaml")
    assert str(raised.value).startswith("keys.yaml: ")


DEEP = 5000
"""Levels of nesting far past Python's recursion limit: the parser recurses once a level or more."""


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "keys.yaml",
            "tenants:\n  - name: a\n    keys: [sk-secret, k2\n",
            r"not valid YAML: while parsing a flow",
        ),
        ("keys", "# tenants\ntenants:\n  - name: a\n    keys: [sk-secret\n", r"not valid YAML: .*\(line 4"),
        ("keys", "tenants:\n\t- name: a\n", r"not valid YAML: .*character '\\t'"),
        ("keys.yml", "@sk-secret\n", "not valid YAML"),
        ("keys", "- sk-secret\n- k2\n", "a YAML list without a top-level `tenants:`"),
        (
            "keys",
            "tenant:\n  - name: a\n    keys: [sk-secret]\n",
            "a YAML mapping without a top-level `tenants:`",
        ),
        ("keys", "[" * DEEP + "]" * DEEP, "nested too deeply"),
        ("keys.json", '{"tenants": ' + "[" * DEEP + "]" * DEEP + "}", "nested too deeply"),
        ("keys", "{a: " * DEEP + "1" + "}" * DEEP, "nested too deeply"),
    ],
    ids=[
        "syntax-error-in-yaml-file",
        "syntax-error-after-a-comment",
        "tab-indent",
        "yaml-name-unparseable",
        "yaml-list-of-keys",
        "misspelt-tenants",
        "deep-list",
        "deep-json",
        "deep-mapping",
    ],
)
def test_a_keys_file_meant_as_yaml_that_is_broken_is_an_error(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        load_api_keys(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert "sk-secret" not in str(raised.value)  # the file's lines are keys: never echoed


@pytest.mark.parametrize(
    ("text", "keys"),
    [
        ("# one per line\nk1\n\n  k2  \n", ["k1", "k2"]),
        ("@k1\n%k2\n", ["@k1", "%k2"]),
        ("user:pass\nk2\n", ["user:pass", "k2"]),
        ("-k1\n", ["-k1"]),
    ],
    ids=["comments-blanks-spaces", "keys-yaml-cannot-read", "colon-inside", "leading-dash"],
)
def test_a_plain_keys_file_is_read_line_by_line(tmp_path: Path, text: str, keys: list[str]) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    loaded = load_api_keys(path)
    assert all(loaded.tenant(f"Bearer {key}") == DEFAULT_TENANT for key in keys)
    assert loaded.tenant("Bearer k3") is None


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("[' k', 'k']", "once"),
        ("[\"k\\t\", 'k']", "once"),
        ("[' ']", "empty"),
        ("['', ' ']", "empty"),
    ],
    ids=["space-before", "tab-after", "blank", "empty-and-blank"],
)
def test_keys_are_stripped_before_they_are_checked(keys: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tenants(f"tenants: [{{name: a, keys: {keys}}}]", source="keys.yaml")


def test_a_tenants_key_is_stripped() -> None:
    pairs = parse_tenants("tenants: [{name: a, keys: [' k1 ']}, {name: b, keys: [k2]}]", source="keys.yaml")
    assert [key for key, _ in pairs or []] == ["k1", "k2"]


@pytest.mark.parametrize(
    ("tenant_priority", "body", "header", "expected"),
    [
        (0, None, None, 0),
        (3, None, None, 3),
        (3, 7, None, 7),
        (3, 1, None, 3),
        (3, -50, None, 3),
        (3, None, "9", 9),
        (3, 5, "4", 5),
        (3, None, " 2 ", 3),
        (0, 10**9, None, LOWEST_PRIORITY),
    ],
    ids=[
        "default",
        "tenant",
        "lowered",
        "raise-refused",
        "negative",
        "header",
        "larger-wins",
        "header-raise",
        "capped",
    ],
)
def test_a_request_may_lower_its_priority_never_raise_it(
    tenant_priority: int, body: int | None, header: str | None, expected: int
) -> None:
    tenant = Tenant(name="t", priority=tenant_priority)
    assert effective_priority(tenant, body, header) == expected


def test_a_priority_header_that_is_no_integer_is_400() -> None:
    with pytest.raises(HttpError) as raised:
        effective_priority(ANONYMOUS, None, "high")
    assert raised.value.status == 400 and "x-herd-priority" in raised.value.message


def tenant_keys() -> ApiKeys:
    return ApiKeys.of_tenants(
        [("k-any", Tenant(name="any", priority=2)), ("k-other", Tenant(name="other", models=("other",)))]
    )


async def test_a_tenant_may_not_call_a_model_outside_its_list() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, api_keys=tenant_keys()) as (_, client):
        refused = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer k-other"}
        )
        listed = await client.get("/v1/models", headers={"authorization": "Bearer k-other"})
        allowed = await client.get("/v1/models", headers={"authorization": "Bearer k-any"})
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == "model"
    assert listed.json()["data"] == [] and [card["id"] for card in allowed.json()["data"]] == [MODEL]
    assert cluster.workers[0].num_requests == 0


@pytest.mark.parametrize(
    ("body", "headers", "sent"),
    [
        ({}, {}, 2),
        ({"priority": 0}, {}, 2),
        ({"priority": 6}, {}, 6),
        ({}, {"x-herd-priority": "4"}, 4),
    ],
    ids=["tenant-default", "raise-capped", "lowered-in-body", "lowered-by-header"],
)
async def test_workers_get_the_effective_priority(
    body: dict[str, int], headers: dict[str, str], sent: int
) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, api_keys=tenant_keys()) as (_, client):
        response = await client.post(
            "/v1/chat/completions",
            json={**CHAT, **body},
            headers={"authorization": "Bearer k-any", **headers},
        )
    assert response.status_code == 200
    assert cluster.workers[0].bodies[0]["priority"] == sent
