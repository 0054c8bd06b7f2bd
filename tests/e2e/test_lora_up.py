"""LoRA under ``herd up``: a manifest with two adapters, requests for both through the gateway, each
served by a worker that holds it; an adapter loaded at runtime through the gateway's admin key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.herd_up import Up, herd_up_of
from support.lora import make_peft_adapter

from herd.api.protocol import WORKER_HEADER

pytestmark = pytest.mark.e2e

ADMIN_KEY = "lora-admin-key"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("up-loras")
    return {
        name: make_peft_adapter(tiny_llama, root / name, rank=rank, seed=seed)
        for name, rank, seed in (("sql", 8, 5), ("poet", 16, 6), ("chef", 4, 7))
    }


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[Up]:
    folder = tmp_path_factory.mktemp("lora-up")
    manifest = folder / "tiny-lora.yaml"
    manifest.write_text(
        f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: tiny}}
spec:
  model: {{source: "file://{tiny_llama}"}}
  engine: {{dtype: float32, device: cpu, maxModelLen: 512, maxLoras: 2, kvCache: {{memoryGiB: 0.05}}}}
  workers: {{replicas: 2}}
  routing: {{strategy: kv_cache_aware}}
  adapters:
    - {{name: sql, source: "file://{adapters["sql"]}", rank: 8}}
    - {{name: poet, source: "file://{adapters["poet"]}", rank: 16}}
"""
    )
    with herd_up_of(manifest, folder, env={"HERD_ADMIN_API_KEYS": ADMIN_KEY}) as up:
        yield up


def ask(up: Up, model: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return httpx.post(f"{up.base_url}/v1/chat/completions", json=body, timeout=60)


def worker_models(up: Up, worker_id: str) -> set[str]:
    """The models a worker itself lists (its public ``/v1/models``), found by the id herd up logged."""
    url = str(up.workers()[worker_id]["url"])
    return {card["id"] for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def test_requests_for_both_adapters_go_to_workers_holding_them(up: Up) -> None:
    answers = {model: [ask(up, model) for _ in range(4)] for model in ("tiny", "sql", "poet")}
    texts = {}
    for model, responses in answers.items():
        assert all(response.status_code == 200 for response in responses), responses[0].text
        assert {response.json()["model"] for response in responses} == {"tiny"}
        texts[model] = {response.json()["choices"][0]["message"]["content"] for response in responses}
        assert len(texts[model]) == 1  # greedy: the same answer on whichever worker
        for response in responses:
            assert model in worker_models(up, response.headers[WORKER_HEADER])
    assert len({text for group in texts.values() for text in group}) == 3  # each adapter answers its own way


def test_the_gateway_lists_the_adapters_and_refuses_unknown_ones(up: Up) -> None:
    cards = httpx.get(f"{up.base_url}/v1/models", timeout=10).json()["data"]
    assert {(card["id"], card["parent"]) for card in cards} >= {
        ("tiny", None),
        ("sql", "tiny"),
        ("poet", "tiny"),
    }
    unknown = ask(up, "nobody")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_an_adapter_loaded_at_runtime_through_the_admin_key(up: Up, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "chef", "lora_path": str(adapters["chef"])}
    url = f"{up.base_url}/v1/load_lora_adapter"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    loaded = httpx.post(url, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    answer = ask(up, "chef")
    assert answer.status_code == 200
    assert "chef" in worker_models(up, answer.headers[WORKER_HEADER])
    unload = {"lora_name": "chef"}
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert (
        httpx.post(
            f"{up.base_url}/v1/unload_lora_adapter", json=unload, headers=headers, timeout=60
        ).status_code
        == 200
    )
    assert ask(up, "chef").status_code == 404
