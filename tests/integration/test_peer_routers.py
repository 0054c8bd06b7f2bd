"""The peer routers of issue 14 route real requests to herd's simulated workers.

Two simulated workers (one ``herd worker --replicas 2`` process) behind each of sglang-router,
smg and vllm-router with each policy the benchmark compares: a chat completion and a streamed one
go through and are answered by the workers (their own request counters say so), and the policies
with prefix affinity send a repeated long prompt to one worker, which then serves it from its
prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from support.peer_routers import PEERS, PeerRouter, peer_router, skip_without_peers
from support.procs import running, wait_until
from support.tiny_models import make_tiny_model
from support.worker_server import sse_data, worker_argv

from herd.cli.up import free_port_block

pytestmark = [skip_without_peers, pytest.mark.e2e]

NUM_WORKERS = 2
SIMULATED = {"backend": "simulated", "simulation": {"costModel": {"stepMs": 2.0, "tokenMs": 0.05}}}
CASES = [(peer, policy) for peer in PEERS.values() for policy in peer.policies]
AFFINITY_POLICIES = {"cache_aware", "prefix_hash", "consistent_hash"}
"""The policies that keep a prompt on one worker; round robin spreads it."""


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The public URLs of two simulated workers serving the tiny model as ``tiny``."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    ports = free_port_block(2 * NUM_WORKERS)
    argv = worker_argv(model, port=ports[0], internal_port=ports[NUM_WORKERS], token="peer-token")
    argv += ["--engine-json", json.dumps(SIMULATED), "--replicas", str(NUM_WORKERS)]
    log = tmp_path_factory.mktemp("workers") / "workers.log"
    urls = [f"http://127.0.0.1:{port}" for port in ports[:NUM_WORKERS]]
    with running(argv, log=log) as process:

        def are_ready() -> bool:
            assert process.poll() is None, f"the simulated workers exited early; see {log}"
            return all(httpx.get(f"{url}/ready", timeout=2).status_code == 200 for url in urls)

        wait_until(are_ready, timeout=60, interval=0.2, what="two simulated workers ready")
        yield urls


def _num_finished(worker: str) -> float:
    """Requests the worker finished, over every finish reason."""
    page = httpx.get(f"{worker}/metrics", timeout=5).text
    samples = (line for line in page.splitlines() if line.startswith("vllm:request_success_total{"))
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def _chat(router: str, content: str, **fields: Any) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "ignore_eos": True,
        **fields,
    }
    return httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60)


@dataclass(frozen=True)
class Routed:
    """A peer router with one policy, started over the workers."""

    peer: PeerRouter
    policy: str
    url: str


@pytest.fixture(scope="module", params=CASES, ids=[f"{peer.distribution}-{policy}" for peer, policy in CASES])
def routed(
    request: pytest.FixtureRequest, workers: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Routed]:
    """Each router with each policy, started once for the tests below."""
    peer, policy = request.param
    log = tmp_path_factory.mktemp("router") / f"{peer.distribution}-{policy}.log"
    with peer_router(peer, policy, workers, log=log) as router:
        yield Routed(peer, policy, router.url)


def test_a_chat_and_a_streamed_chat_go_through_to_the_workers(routed: Routed, workers: list[str]) -> None:
    before = [_num_finished(worker) for worker in workers]
    answer = _chat(routed.url, f"Say hello through {routed.peer.distribution}.")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    streamed = _chat(routed.url, "Stream a greeting.", stream=True, stream_options={"include_usage": True})
    assert streamed.status_code == 200, streamed.text
    chunks = sse_data(streamed.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == 4
    after = [_num_finished(worker) for worker in workers]
    assert sum(after) - sum(before) == 2


def test_a_repeated_long_prompt_stays_on_one_worker_under_affinity_policies(
    routed: Routed, workers: list[str]
) -> None:
    prompt = f"{routed.peer.distribution} {routed.policy}: " + "a long system prompt for one tenant. " * 20
    before = [_num_finished(worker) for worker in workers]
    answers = [_chat(routed.url, prompt).json() for _ in range(4)]
    served = [_num_finished(worker) - was for worker, was in zip(workers, before, strict=True)]
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    if routed.policy in AFFINITY_POLICIES:
        assert sorted(served) == [0, 4], f"{routed.policy} spread one prompt over the workers: {served}"
        # The first answer shares only the chat template's opening with earlier requests.
        assert all(tokens > cached[0] for tokens in cached[1:]), cached
    else:
        assert served == [2, 2], f"{routed.policy} did not alternate: {served}"
