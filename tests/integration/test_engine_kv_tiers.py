"""KV tiers below the device pool on the torch runner: outputs unchanged, blocks restored bit for bit,
a failing disk tier dropped without failing a request."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.engine import GREEDY, make_config, make_engine, random_prompts, tier_gib

from herd.api.kv_hash import block_hashes
from herd.worker.async_engine import AsyncEngine
from herd.worker.engine import LLMEngine
from herd.worker.kv_store import DiskFile
from herd.worker.model_runner import TorchRunner, torch_engine
from herd.worker.server import PublicOptions, build_public_app

POOL_BLOCKS = 12
"""Each prompt below needs 5-6 blocks: a pool of 12 holds two, so cycling four evicts every time."""


def tiered_engine(path: Path, host_blocks: int, disk: dict[str, Any] | None = None) -> LLMEngine:
    kv_cache: dict[str, Any] = {"hostMemoryGiB": tier_gib(path, host_blocks)}
    if disk is not None:
        kv_cache["disk"] = disk
    return make_engine(path, num_blocks=POOL_BLOCKS, kvCache=kv_cache)


def cycle(engine: LLMEngine, prompts: list[list[int]], rounds: int = 3) -> list[list[int]]:
    """Each prompt in turn, ``rounds`` times, one at a time: the greedy tokens of every request."""
    return [engine.generate([prompt], GREEDY)[0].new_token_ids for _ in range(rounds) for prompt in prompts]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([70, 80, 75, 90], vocab_size=384, seed=21)


@pytest.fixture(scope="module")
def untiered(tiny_llama: Path, prompts: list[list[int]]) -> list[list[int]]:
    return cycle(make_engine(tiny_llama, num_blocks=POOL_BLOCKS), prompts)


@pytest.mark.parametrize(
    ("host_blocks", "disk_gib_blocks", "restored_from"),
    [(64, 0, {"host"}), (8, 64, {"host", "disk"})],
    ids=["host", "host-and-disk"],
)
def test_greedy_output_is_identical_with_tiers_on_and_off(
    tiny_llama: Path,
    prompts: list[list[int]],
    untiered: list[list[int]],
    tmp_path: Path,
    host_blocks: int,
    disk_gib_blocks: int,
    restored_from: set[str],
) -> None:
    disk = (
        {"path": str(tmp_path), "sizeGiB": tier_gib(tiny_llama, disk_gib_blocks)} if disk_gib_blocks else None
    )
    engine = tiered_engine(tiny_llama, host_blocks, disk)
    assert cycle(engine, prompts) == untiered
    counters = engine.block_manager.counters
    assert set(counters.restored) == restored_from
    assert engine.stats.prefix_cache_hits > 0
    report = engine.load_report()
    assert set(report.restore_bytes_per_s) == restored_from
    assert report.prefill_tokens_per_s is not None and report.prefill_tokens_per_s > 0


@pytest.mark.parametrize("by", ["prompt", "lease"])
def test_a_restored_block_is_bit_identical(tiny_llama: Path, prompts: list[list[int]], by: str) -> None:
    """Blocks the host tier holds come back bit for bit, for a prompt that hits them and for a peer's
    lease on them (a pull from this worker)."""
    engine = tiered_engine(tiny_llama, 64)
    first, *others = prompts
    engine.generate([first], GREEDY)
    hashes = block_hashes(first, 16, model_id="test-model")
    before = engine.read_blocks([engine.block_manager.cached[h] for h in hashes])
    for prompt in others:
        engine.generate([prompt], GREEDY)
    assert not set(hashes) & engine.block_manager.cached.keys()  # all evicted from the device
    if by == "prompt":
        [again] = engine.generate([first], GREEDY)
        assert again.num_cached_tokens == len(hashes) * 16
        restored = [engine.block_manager.cached[h] for h in hashes]
    else:
        run = engine.hold_cached("lease", hashes)
        restored = run.block_ids
        assert (len(restored), run.end) == (len(hashes), "whole")
    assert torch.equal(engine.read_blocks(restored), before)
    assert engine.release_held("lease") == (len(hashes) if by == "lease" else 0)


def test_events_name_the_tier_and_the_snapshot_lists_each(tiny_llama: Path, prompts: list[list[int]]) -> None:
    engine = tiered_engine(tiny_llama, 64)
    cycle(engine, prompts, rounds=1)
    events = engine.drain_kv_events()
    assert {(event.kind, event.medium) for event in events} >= {
        ("stored", "device"),
        ("removed", "device"),
        ("stored", "host"),
    }
    snapshot = engine.kv_snapshot()
    assert set(snapshot.tier_block_hashes["host"]) == set(engine.block_manager.host.slots)  # type: ignore[union-attr]


def test_a_failing_disk_tier_is_dropped_and_no_request_fails(
    tiny_llama: Path, prompts: list[list[int]], untiered: list[list[int]], tmp_path: Path, caplog: Any
) -> None:
    engine = tiered_engine(tiny_llama, 6, {"path": str(tmp_path), "sizeGiB": tier_gib(tiny_llama, 64)})
    runner = engine.runner
    assert isinstance(runner, TorchRunner) and runner.tiers.disk is not None
    disk = runner.tiers.disk.file
    assert isinstance(disk, DiskFile)
    assert cycle(engine, prompts, rounds=1) == untiered[: len(prompts)]
    assert engine.block_manager.counters.stored["disk"] > 0
    assert runner.tiers.disk.wait_written(timeout=10)
    broken = os.open(os.devnull, os.O_RDONLY)  # reads give 0 bytes, writes fail: a dying disk
    os.dup2(broken, disk.fd)
    os.close(broken)
    outputs = [engine.generate([prompt], GREEDY)[0] for _ in range(2) for prompt in prompts]
    assert [output.error for output in outputs] == [None] * len(outputs)
    assert [output.new_token_ids for output in outputs] == untiered[len(prompts) :]
    assert engine.block_manager.disk is None and runner.tiers.disk is None
    assert [r.message for r in caplog.records].count("KV tier failed; the engine goes on without it") == 1


def test_a_disk_tier_that_cannot_be_made_is_off(tiny_llama: Path, tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    engine = tiered_engine(tiny_llama, 6, {"path": str(not_a_folder / "kv"), "sizeGiB": 0.01})
    assert engine.block_manager.disk is None
    assert engine.block_manager.host is not None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_worker_reports_each_tier_in_its_metrics(
    tiny_llama: Path, prompts: list[list[int]]
) -> None:
    config = make_config(
        tiny_llama, num_blocks=POOL_BLOCKS, kvCache={"hostMemoryGiB": tier_gib(tiny_llama, 64)}
    )
    front = AsyncEngine(lambda: torch_engine(config))
    front.start()
    await front.wait_loaded()
    try:
        app = build_public_app(front, PublicOptions("test-model", max_body_bytes=100_000))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            for prompt in [*prompts, prompts[0]]:
                body = {"model": "test-model", "prompt": prompt, "max_tokens": 2, "temperature": 0}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
    finally:
        await front.stop()
    for name in (
        'herd_kv_tier_usage_perc{medium="host",model_name="test-model"}',
        'herd_kv_tier_blocks{medium="host",model_name="test-model"} 64.0',
        'herd_kv_tier_stored_blocks_total{medium="host",model_name="test-model"}',
        'herd_kv_tier_restored_blocks_total{medium="host",model_name="test-model"}',
        'herd_kv_tier_evicted_blocks_total{medium="device",model_name="test-model"}',
        'herd_kv_tier_restore_bytes_per_second{medium="host",model_name="test-model"}',
        'herd_prefill_tokens_per_second{model_name="test-model"}',
    ):
        assert f"\n{name}" in text, name
