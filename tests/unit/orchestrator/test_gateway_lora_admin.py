"""Runtime LoRA changes at the gateway over fake workers: a load that one worker refuses is undone on
the workers that took it (so the adapter is served by none and a retry is not told its name is
taken), and a worker's answer that is not about the adapter is a 502, not passed on as the admin's."""

from __future__ import annotations

import pytest
from support.gateway_fakes import FakeCluster, FakeWorker, running_gateway

from herd.api.protocol import LoadReport
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.lora_admin import LOAD_LORA_PATH

ADMIN = {"Authorization": "Bearer admin-key"}
LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


async def test_a_load_one_worker_refuses_is_undone_on_the_others_and_a_retry_succeeds() -> None:
    taker, refuser = FakeWorker("w0"), FakeWorker("w1", lora_status=400)
    async with running_gateway(FakeCluster([taker, refuser]), admin_keys=ApiKeys(["admin-key"])) as (
        _,
        client,
    ):
        refused = await client.post(LOAD_LORA_PATH, json=LOAD, headers=ADMIN)
        assert refused.status_code == 400 and "refuses the adapter" in refused.json()["error"]["message"]
        assert taker.lora_changes == ["load sql", "unload sql"] and taker.adapters == []
        models = (await client.get("/v1/models")).json()["data"]
        assert "sql" not in {model["id"] for model in models}
        refuser.lora_status = 200
        assert (await client.post(LOAD_LORA_PATH, json=LOAD, headers=ADMIN)).status_code == 200
        assert taker.adapters == refuser.adapters == ["sql"]


async def test_a_load_is_not_undone_where_the_adapter_was_already_loaded() -> None:
    holder = FakeWorker("w0", adapters=["sql"], load=LoadReport(lora_adapters=["sql"]))
    refuser = FakeWorker("w1", lora_status=409)
    async with running_gateway(FakeCluster([holder, refuser]), admin_keys=ApiKeys(["admin-key"])) as (
        _,
        client,
    ):
        assert (await client.post(LOAD_LORA_PATH, json=LOAD, headers=ADMIN)).status_code == 409
    assert holder.lora_changes == ["load sql"]


@pytest.mark.parametrize("status", [204, 401, 403, 500])
async def test_a_workers_answer_that_is_not_about_the_adapter_is_a_502(status: int) -> None:
    worker = FakeWorker("w0", lora_status=status)
    async with running_gateway(FakeCluster([worker]), admin_keys=ApiKeys(["admin-key"])) as (_, client):
        response = await client.post(LOAD_LORA_PATH, json=LOAD, headers=ADMIN)
    assert response.status_code == 502
    assert f"worker w0 answered the LoRA load with {status}" in response.json()["error"]["message"]
