"""The oracle on hand-made tables (blocks of 4 tokens), and its pool against herd's own engine."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from support.engine import make_config

from herd.api.prompt import PromptRenderer
from herd.cli.loadgen.oracle import (
    BestIdeal,
    OracleRequest,
    WorkerPool,
    best_ideal_hit_rate,
    ceiling_hit_rate,
    ideal_hit_rate,
    oracle_report,
    oracle_request,
)
from herd.cli.loadgen.traces import load_trace
from herd.cli.main import main
from herd.worker.sampling_params import SamplingParams
from herd.worker.simulated_runner import simulated_engine

BLOCK = 4


def _blocks(*names: str) -> list[int]:
    """Token ids of full blocks named by letters: the same letter at the same place is the same block."""
    return [ord(name) * 10 + offset for name in names for offset in range(BLOCK)]


def _request(*names: str, tail: int = 1, output: int = 1) -> OracleRequest:
    """A prompt of the named blocks plus ``tail`` tokens of its own (a tail of 0 ends on a block)."""
    own = [random.Random(str(names) + str(tail)).randrange(1000, 2000)] * tail
    return oracle_request(_blocks(*names) + own, output, block_size=BLOCK, model_id="m")


A, B, C = _request("a", "b"), _request("c", "d"), _request("e", "f")
D = _request("a", "b", "c")


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        ([A, A], 8 / 18),
        ([_request("a", "b", tail=0), _request("a", "b", tail=0)], 4 / 16),
        ([A, _request("a", "x")], 4 / 18),
        ([A, B], 0.0),
        ([A, B, C, A, B, C], 24 / 54),
    ],
    ids=[
        "repeat",
        "whole-prompt-hit-recomputes-the-last-block",
        "shared-first-block",
        "distinct",
        "three-prefixes",
    ],
)
def test_the_ceiling_hits_every_full_block_seen_before(
    requests: list[OracleRequest], expected: float
) -> None:
    assert ceiling_hit_rate(requests, block_size=BLOCK) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("requests", "num_workers", "num_blocks", "expected"),
    [
        ([A, B, A, B, C, A], 2, 100, 24 / 54),
        ([A, B, A, B], 1, 3, 0.0),
        ([A, B, A, B], 2, 3, 16 / 36),
        ([A, B, A], 1, 5, 8 / 27),
        ([_request("a", "b", "c"), B, C, _request("a", "b", "c")], 1, 6, 4 / 44),
        ([A, _request("c", "d", output=1), A], 1, 4, 4 / 27),
        ([A, _request("c", "d", output=8), A], 1, 4, 0.0),
        ([A, B, A, C, B], 2, 3, 8 / 45),
        ([D, B, C, B, D], 2, 5, 20 / 53),
    ],
    ids=[
        "room-for-everything-reaches-the-ceiling",
        "one-small-worker-thrashes",
        "two-small-workers-each-keep-a-prefix",
        "one-worker-is-one-lru-pool",
        "a-request-is-evicted-tail-first",
        "a-short-answer-leaves-room",
        "decoded-blocks-evict-too",
        "ties-go-to-the-least-recently-used-worker",
        "no-hit-goes-to-the-emptiest-worker",
    ],
)
def test_the_ideal_router(
    requests: list[OracleRequest], num_workers: int, num_blocks: int, expected: float
) -> None:
    rate = ideal_hit_rate(requests, num_workers=num_workers, blocks_per_worker=num_blocks, block_size=BLOCK)
    assert rate == pytest.approx(expected)


@pytest.mark.parametrize(
    ("follow_share", "expected"),
    [(0.0, 12 / 36), (0.25, 12 / 36), (0.5, 16 / 36)],
    ids=["every-hit", "a-quarter", "half"],
)
def test_a_block_every_prompt_shares_is_not_worth_following(follow_share: float, expected: float) -> None:
    """Two chats behind one common block (as a chat template's default system prompt): following
    that block crowds both onto one small worker, where they evict each other."""
    first, second = _request("z", "a"), _request("z", "b")
    requests = [first, second, first, second]
    fleet = {"num_workers": 2, "blocks_per_worker": 3, "block_size": BLOCK}
    assert ideal_hit_rate(requests, **fleet, follow_share=follow_share) == pytest.approx(expected)
    assert best_ideal_hit_rate(requests, **fleet) == BestIdeal(pytest.approx(16 / 36), 0.5, 2)


def test_capacity_pressure_lowers_the_oracle_down_from_the_ceiling() -> None:
    rng = random.Random(3)
    names = "abcdefgh"
    requests = [_request(name, name.upper(), tail=rng.randint(1, 9)) for name in rng.choices(names, k=200)]
    ceiling = ceiling_hit_rate(requests, block_size=BLOCK)
    rates = [
        ideal_hit_rate(requests, num_workers=2, blocks_per_worker=blocks, block_size=BLOCK)
        for blocks in (6, 12, 24, 1000)
    ]
    assert rates == sorted(rates)
    assert rates[0] < ceiling
    assert rates[-1] == pytest.approx(ceiling)


def test_a_fleet_twice_as_large_never_scores_lower() -> None:
    rng = random.Random(11)
    requests = [_request(name, "q", tail=rng.randint(1, 9)) for name in rng.choices("abcdefghijkl", k=300)]
    best = [
        best_ideal_hit_rate(requests, num_workers=size, blocks_per_worker=9, block_size=BLOCK)
        for size in (1, 2, 4, 8)
    ]
    assert [b.hit_rate for b in best] == sorted(b.hit_rate for b in best)
    assert best[0].hit_rate < best[-1].hit_rate
    assert all(b.num_workers <= size for b, size in zip(best, (1, 2, 4, 8), strict=True))


def test_a_request_larger_than_a_worker_names_the_fix() -> None:
    with pytest.raises(ValueError, match="raise --blocks-per-worker"):
        ideal_hit_rate([A], num_workers=1, blocks_per_worker=2, block_size=BLOCK)


def test_the_report_carries_the_fleet_and_both_rates() -> None:
    report = oracle_report([A, B, A, B], num_workers=1, blocks_per_worker=3, block_size=BLOCK)
    assert report == {
        "num_requests": 4,
        "num_prompt_tokens": 36,
        "workers": 1,
        "blocks_per_worker": 3,
        "block_size": BLOCK,
        "oracle_hit_rate": 0.0,
        "oracle_follow_share": 0.0,
        "oracle_workers_used": 1,
        "ceiling_hit_rate": 0.4444,
    }


def test_one_pool_caches_what_herds_engine_caches(tiny_llama: Path) -> None:
    """Requests one at a time through herd's engine (cost-model runner, real scheduler and block
    manager) and through one oracle pool of the same size: the same cached tokens, request by request."""
    num_blocks, block_size = 14, 16
    engine = simulated_engine(make_config(tiny_llama, num_blocks=num_blocks), num_blocks=num_blocks)
    pool = WorkerPool(num_blocks, block_size)
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 384) for _ in range(rng.choice([32, 40]))] for _ in range(4)]
    for _ in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 384) for _ in range(rng.randint(0, 30))]
        num_output = rng.randint(1, 24)
        params = SamplingParams(max_tokens=num_output, ignore_eos=True)
        [output] = engine.generate([prompt], params)
        expected = pool.serve(
            oracle_request(prompt, num_output, block_size=block_size, model_id="test-model")
        )
        assert output.num_cached_tokens == expected


def test_the_cli_renders_the_trace_as_workers_do(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "chat.jsonl"
    options = ["--num-sessions", "3", "--num-turns", "3", "--user-len", "20", "--output-len", "4"]
    assert main(["bench", "trace", "--kind", "multi-turn", "--out", str(trace), *options]) == 0
    capsys.readouterr()
    fleet = ["--workers", "2", "--blocks-per-worker", "200", "--block-size", str(BLOCK)]
    assert main(["bench", "oracle", "--trace", str(trace), "--model", str(tiny_llama), *fleet]) == 0
    report = json.loads(capsys.readouterr().out)
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    requests = [
        oracle_request(
            renderer.encode_chat([m.model_dump() for m in request.messages]),
            request.output_length,
            block_size=BLOCK,
            model_id="any",
        )
        for request in load_trace(trace)
    ]
    expected = oracle_report(requests, num_workers=2, blocks_per_worker=200, block_size=BLOCK)
    assert report == {"trace": str(trace), **expected}
    assert 0 < report["oracle_hit_rate"] <= report["ceiling_hit_rate"] < 1


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        (
            ["--workers", "0", "--blocks-per-worker", "8"],
            "the oracle needs at least one worker and one block",
        ),
        (["--workers", "1", "--blocks-per-worker", "2"], "raise --blocks-per-worker"),
    ],
    ids=["no-workers", "pool-too-small"],
)
def test_the_cli_names_what_to_fix(
    fleet: list[str], message: str, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["bench", "trace", "--kind", "multi-turn", "--out", str(trace), "--num-sessions", "1"]) == 0
    code = main(["bench", "oracle", "--trace", str(trace), "--model", str(tiny_llama), *fleet])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_model_folder_without_a_tokenizer_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["bench", "trace", "--kind", "multi-turn", "--out", str(trace), "--num-sessions", "1"]) == 0
    fleet = ["--workers", "1", "--blocks-per-worker", "8"]
    assert main(["bench", "oracle", "--trace", str(trace), "--model", str(tmp_path), *fleet]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
