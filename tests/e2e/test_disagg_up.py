"""``herd up`` of a disaggregated deployment (1 prefill + 1 decode worker), driven by the openai SDK.

Tiny-model manifest in tmp_path for speed. The prefill worker is killed in the last-but-one test
(requests still succeed: the decode worker prefills locally) and the decode worker in the last one
(a stream in flight ends with an error event).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.herd_up import Up, herd_up_of, shipped_example
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "tiny"
LONG_PROMPT = " ".join(f"item{number % 23} costs {number} coins" for number in range(24))


def write_manifest(folder: Path, model: Path) -> Path:
    path = folder / "tiny-disagg.yaml"
    path.write_text(
        f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: tiny-disagg}}
spec:
  model: {{source: "file://{model}", servedName: {MODEL}}}
  engine: {{dtype: float32, device: cpu, maxModelLen: 2048, kvCache: {{blockSize: 16, memoryGiB: 0.05}}}}
  serving: {{mode: disaggregated, prefillThresholdTokens: 32}}
  prefill: {{replicas: 1}}
  decode: {{replicas: 1}}
  routing: {{strategy: kv_cache_aware}}
"""
    )
    return path


@pytest.fixture(scope="module")
def herd_up(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Up]:
    tmp_path = tmp_path_factory.mktemp("herd-up-disagg")
    with herd_up_of(write_manifest(tmp_path, tiny_llama), tmp_path) as up:
        yield up


def metric(url: object, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples (lines containing ``label``) on a worker's /metrics page."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and label in line)


def streamed_text(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def direct_text(url: object, prompt: str, max_tokens: int = 12) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return str(
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"][
            "content"
        ]
    )


def kv_usage(url: object) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def test_openai_sdk_streams_from_the_decode_worker_after_a_remote_prefill(herd_up: Up) -> None:
    prefill, decode = herd_up.worker("prefill")["url"], herd_up.worker("decode")["url"]
    received = "herd_kv_transfer_blocks_total"
    before = metric(decode, received, 'direction="received"')
    text = streamed_text(herd_up.client(), LONG_PROMPT)
    assert metric(decode, received, 'direction="received"') > before
    assert metric(prefill, received, 'direction="sent"') > 0
    assert text == direct_text(prefill, LONG_PROMPT)
    response = httpx.post(
        f"{herd_up.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 200 and response.headers[WORKER_HEADER].endswith("-decode-0")
    wait_until(lambda: kv_usage(prefill) == 0 and kv_usage(decode) == 0, timeout=60, what="every block free")


def test_requests_survive_the_prefill_worker_dying(herd_up: Up) -> None:
    os.kill(int(str(herd_up.worker("prefill")["pid"])), signal.SIGKILL)
    prompt = LONG_PROMPT.replace("coins", "pearls")
    assert streamed_text(herd_up.client(), prompt) == direct_text(herd_up.worker("decode")["url"], prompt)
    wait_until(lambda: kv_usage(herd_up.worker("decode")["url"]) == 0, timeout=60, what="decode blocks free")


def read_killing(stream: openai.Stream[object], pid: int, *, after: int = 2) -> None:
    """Read ``stream`` to its end, SIGKILLing ``pid`` once ``after`` chunks have arrived."""
    for number, _ in enumerate(stream):
        if number == after:
            os.kill(pid, signal.SIGKILL)


def test_a_dying_decode_worker_ends_the_stream_with_an_error(herd_up: Up) -> None:
    stream = herd_up.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=1600,  # far more than any machine decodes between the second chunk and the kill
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError):
        read_killing(stream, int(str(herd_up.worker("decode")["pid"])))


@pytest.mark.slow
def test_the_smollm2_disagg_example_streams_to_the_openai_sdk(tmp_path: Path, demo_model: Path) -> None:
    """The shipped example, its relative model path made absolute (tests may run from anywhere)."""
    manifest = shipped_example("smollm2-disagg.yaml", tmp_path, demo_model)
    assert "mode: disaggregated" in manifest.read_text()
    with herd_up_of(manifest, tmp_path) as up:
        # About 400 SmolLM2 tokens: above the example's prefillThresholdTokens (256).
        prompt = (
            "Summarize these lists in one sentence: "
            + LONG_PROMPT
            + " "
            + LONG_PROMPT.replace("coins", "pearls")
        )
        client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=16, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip()
        assert metric(up.worker("decode")["url"], "herd_kv_transfer_blocks_total", 'direction="received"') > 0
