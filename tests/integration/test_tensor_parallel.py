"""Tensor parallelism on the CPU (gloo): TP=2 gives the greedy tokens of TP=1, on a tiny random
Llama (its heads split evenly) and on SmolLM2 (9 query and 3 KV heads: split 2 + 1 KV groups), in
process, as a ``herd worker --tensor-parallel-size 2`` process serving the OpenAI API, and as two
``herd worker`` processes that stand for two pods of a LeaderWorkerSet group (a leader serving HTTP
with rank 0, a follower with rank 1), joined over TCP on loopback; with n-gram speculation too."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from support.procs import child_pids, free_port, is_running, running, stop_process, wait_until
from support.worker_server import engine_config, worker_argv, worker_process

from herd.worker.engine import LLMEngine
from herd.worker.model_runner import TorchRunner, torch_engine
from herd.worker.models import UnsupportedModelError
from herd.worker.parallel import await_ranks, listen, partition
from herd.worker.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(600)]

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Tell me a story about a cat.", "Kubernetes runs pods on"]


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [output.new_token_ids for output in engine.generate(prompts, PARAMS)]


def tokens_at(model: Path, size: int, prompts: list[str], **engine: object) -> list[list[int]]:
    """The greedy tokens of ``prompts`` (a batch, then a prefix-cached rerun) on ``size`` ranks."""
    built = torch_engine(engine_config(model, tensorParallelSize=size, **engine))
    try:
        ids = [built.renderer.encode(prompt) for prompt in prompts]
        first, again = greedy(built, ids), greedy(built, ids)
        assert first == again  # the second run reads the prefix cache the first one wrote, per rank
        return first
    finally:
        runner = built.runner
        assert isinstance(runner, TorchRunner)
        runner.close()


@pytest.mark.parametrize(
    ("total", "parts", "expected"),
    [
        (4, 2, [(0, 2), (2, 2)]),
        (3, 2, [(0, 2), (2, 1)]),
        (1536, 2, [(0, 768), (768, 768)]),
        (5, 3, [(0, 2), (2, 2), (4, 1)]),
    ],
)
def test_partition_cuts_near_equal_runs(total: int, parts: int, expected: list[tuple[int, int]]) -> None:
    assert [partition(total, parts, index) for index in range(parts)] == expected


def test_tp2_matches_tp1_on_a_tiny_llama(tiny_llama: Path) -> None:
    assert tokens_at(tiny_llama, 2, QUESTIONS, maxBatchTokens=32) == tokens_at(
        tiny_llama, 1, QUESTIONS, maxBatchTokens=32
    )


@pytest.mark.slow
def test_tp2_matches_tp1_on_the_demo_model(demo_model: Path) -> None:
    engine = {"maxModelLen": 512, "kvCache": {"blockSize": 16, "memoryGiB": 0.05}}
    expected = tokens_at(demo_model, 1, QUESTIONS, **engine)
    assert tokens_at(demo_model, 2, QUESTIONS, **engine) == expected


def test_a_model_with_fewer_kv_heads_than_ranks_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="2 KV heads cannot split over 3 ranks"):
        torch_engine(engine_config(tiny_llama, tensorParallelSize=3))


def texts_at(model: Path, size: int, prompts: list[list[int]]) -> list[str]:
    """The greedy completions of ``prompts`` on an in-process engine of ``size`` ranks."""
    built = torch_engine(engine_config(model, tensorParallelSize=size))
    try:
        return [output.new_text for output in built.generate(prompts, PARAMS)]
    finally:
        runner = built.runner
        assert isinstance(runner, TorchRunner)
        runner.close()


def served_texts(url: str) -> tuple[list[list[int]], list[str]]:
    """``QUESTIONS`` tokenized by the worker at ``url`` and their greedy completions, in order."""
    prompts = [
        httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]
        for text in QUESTIONS
    ]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    served = sorted(answer.json()["choices"], key=lambda choice: choice["index"])
    return prompts, [choice["text"] for choice in served]


def test_a_tp2_worker_process_serves_tp1_greedy_tokens_and_stops_its_rank(
    tiny_llama: Path, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with worker_process(tiny_llama, log=log, token="t", tensor_parallel_size="2") as worker:
        ranks = child_pids(worker.process.pid)
        prompts, texts = served_texts(worker.url)
        stop_process(worker.process)
        assert worker.process.returncode == 0, log.read_text()
    assert texts == texts_at(tiny_llama, 1, prompts)
    assert len(ranks) >= 1  # rank 1, and multiprocessing's resource tracker
    wait_until(lambda: not any(is_running(pid) for pid in ranks), timeout=10, what="the ranks stopped")


def rank_argv(model: Path, **flags: str) -> list[str]:
    """``herd worker`` of a model split over 2 ranks, on free loopback ports; ``flags`` place its pod."""
    return worker_argv(
        model, port=free_port(), internal_port=free_port(), token="t", tensor_parallel_size="2", **flags
    )


def test_a_leader_and_a_follower_worker_process_serve_tp1_greedy_tokens(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The follower finds its group as a LeaderWorkerSet pod does, from LWS_* env vars; it starts
    first and waits for the leader's store. Stopping the leader ends the follower cleanly (exit 0)."""
    rendezvous = str(free_port())
    lws_env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "127.0.0.1"}
    follower_log, leader_log = tmp_path / "follower.log", tmp_path / "leader.log"
    with (
        running(rank_argv(tiny_llama, rendezvous_port=rendezvous), log=follower_log, env=lws_env) as follower,
        worker_process(
            tiny_llama,
            log=leader_log,
            token="t",
            tensor_parallel_size="2",
            group_size="2",
            group_index="0",
            rendezvous_port=rendezvous,
        ) as leader,
    ):
        prompts, texts = served_texts(leader.url)
        stop_process(leader.process)
        assert leader.process.returncode == 0, leader_log.read_text()
        assert follower.wait(timeout=30) == 0, follower_log.read_text()
    assert texts == texts_at(tiny_llama, 1, prompts)


def test_a_leader_whose_follower_never_joins_exits_naming_the_rank(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "leader.log"
    argv = rank_argv(tiny_llama, group_size="2", rendezvous_port=str(free_port()), join_timeout="2")
    with running(argv, log=log) as leader:
        assert leader.wait(timeout=120) == 1
    assert "tensor-parallel ranks [1] did not join rank 0 within 0:00:02" in log.read_text()


def test_a_follower_without_a_leader_exits_naming_the_address(tiny_llama: Path, tmp_path: Path) -> None:
    log, rendezvous = tmp_path / "follower.log", free_port()
    argv = rank_argv(
        tiny_llama,
        group_size="2",
        group_index="1",
        leader_address="127.0.0.1",
        rendezvous_port=str(rendezvous),
        join_timeout="2",
    )
    with running(argv, log=log) as follower:
        assert follower.wait(timeout=120) == 1
    assert f"rendezvous store at 127.0.0.1:{rendezvous} did not answer" in log.read_text()


def test_ranks_started_from_a_thread_outlive_it(tiny_llama: Path) -> None:
    """A worker builds its engine on a thread; the ranks it starts follow rank 0's process, not that
    thread (Linux's parent-death signal would have killed them when the thread ended)."""
    built: list[LLMEngine] = []
    builder = threading.Thread(
        target=lambda: built.append(torch_engine(engine_config(tiny_llama, tensorParallelSize=2)))
    )
    builder.start()
    builder.join()
    engine = built[0]
    try:
        ids = [engine.renderer.encode(prompt) for prompt in QUESTIONS]
        assert greedy(engine, ids) == tokens_at(tiny_llama, 1, QUESTIONS)
    finally:
        engine.close()


def test_rank_0_stops_waiting_once_a_rank_died() -> None:
    store = listen(2)
    checks: list[int] = []

    def check_alive() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise RuntimeError("rank 1 exited with code 1")

    with pytest.raises(RuntimeError, match="rank 1 exited"):
        await_ranks(store, 2, check_alive, timedelta(minutes=5))


def test_rank_0_names_the_ranks_that_never_joined() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not join rank 0"):
        await_ranks(listen(2), 2, lambda: None, timedelta(seconds=0.5))


NGRAM = {"method": "ngram", "numTokens": 3, "adaptive": False, "promptLookupMin": 1}


def test_tp2_with_ngram_speculation_matches_tp1(tiny_llama: Path) -> None:
    """Rank 0 proposes and verifies; the proposed tokens reach every rank in the step's inputs."""
    passage = [(7 * index) % 300 + 3 for index in range(40)]
    prompts = [passage + passage[:20], passage[5:] + passage[5:25]]
    expected = greedy(torch_engine(engine_config(tiny_llama)), prompts)
    built = torch_engine(engine_config(tiny_llama, tensorParallelSize=2, speculative=NGRAM))
    try:
        assert greedy(built, prompts) == expected
        assert built.stats.spec_num_drafts > 0  # the verification ran under tensor parallelism
    finally:
        runner = built.runner
        assert isinstance(runner, TorchRunner)
        runner.close()
