"""Traces: deterministic generation, the shape of each kind, the JSONL format and its errors."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from herd.cli.loadgen.traces import (
    HASH_BLOCK_WORDS,
    TRACE_SPEC,
    TraceError,
    TraceRequest,
    dump_trace,
    generate,
    load_trace,
    parse_trace,
)
from herd.cli.main import main

SMALL: dict[str, dict[str, Any]] = {
    "shared-prefix": {"num_groups": 3, "prompts_per_group": 5, "system_prompt_len": 100, "question_len": 20},
    "multi-turn": {"num_sessions": 4, "num_turns": 3, "user_len": "10:20", "output_len": "5:9"},
    "mooncake": {"num_requests": 80, "app_context_len": 64, "tool_result_len": "8:16", "chat_len": "8:16"},
    "hot-burst": {"num_requests": 60, "num_prefixes": 4, "prefix_len": 40, "burst_requests": 20},
}


def _trace(kind: str, seed: int = 0, **options: Any) -> list[TraceRequest]:
    return generate(TRACE_SPEC.validate_python({"kind": kind, **SMALL[kind], **options}), seed)


def _words(request: TraceRequest, index: int) -> int:
    return len(request.messages[index].content.split())


def _sessions(requests: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in requests:
        sessions[request.session_id].append(request)
    return sessions


def _common_prefix(a: list[int], b: list[int]) -> int:
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))


@pytest.mark.parametrize("kind", list(SMALL))
def test_the_same_seed_writes_the_same_bytes(kind: str, tmp_path: Path) -> None:
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    for path, seed in zip(paths, (7, 7, 8), strict=True):
        dump_trace(_trace(kind, seed), path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    requests = load_trace(paths[0])
    assert requests == _trace(kind, 7)
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    assert requests[0].timestamp == 0


def test_shared_prefix_has_sglangs_shape() -> None:
    requests = _trace("shared-prefix", output_len=7)
    sessions = _sessions(requests)
    assert sorted(sessions) == ["group-0", "group-1", "group-2"]
    assert all(len(group) == 5 for group in sessions.values())
    assert all([m.role for m in r.messages] == ["system", "user"] for r in requests)
    assert {(_words(r, 0), _words(r, 1), r.output_length) for r in requests} == {(100, 20, 7)}
    assert all(len({r.messages[0].content for r in group}) == 1 for group in sessions.values())
    assert len({r.messages[1].content for r in requests}) == 15
    assert [r.session_id for r in requests[:5]] != ["group-0"] * 5  # shuffled, as SGLang does
    shared = (100 + 1) // HASH_BLOCK_WORDS  # the role marker counts as a word
    for a, b in itertools.combinations(requests, 2):
        expected = shared if a.session_id == b.session_id else 0
        assert _common_prefix(a.hash_ids, b.hash_ids) == expected


def test_multi_turn_sessions_resend_their_history() -> None:
    requests = _trace("multi-turn")
    sessions = _sessions(requests)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert [len(turn.messages) for turn in turns] == [1, 3, 5]
        for earlier, later in itertools.pairwise(turns):
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert len(later.messages[len(earlier.messages)].content.split()) == earlier.output_length
            assert later.hash_ids[: len(earlier.hash_ids)] == earlier.hash_ids
        assert all(10 <= _words(turn, -1) <= 20 and 5 <= turn.output_length <= 9 for turn in turns)
    rounds = [requests[i : i + 4] for i in range(0, 12, 4)]  # every session's turn k before any turn k+1
    assert all(sorted(r.session_id for r in round_) == sorted(sessions) for round_ in rounds)


def test_mooncake_mixes_tool_agents_on_shared_contexts_with_chats() -> None:
    requests = _trace("mooncake", num_apps=2)
    assert len(requests) == 80
    sessions = _sessions(requests)
    agents = {name: calls for name, calls in sessions.items() if name.startswith("agent-")}
    assert agents and len(agents) < len(sessions)
    assert len({calls[0].messages[0].content for calls in agents.values()}) == 2
    for calls in agents.values():
        for earlier, later in itertools.pairwise(calls):
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert later.messages[-1].content.startswith("tool result: ")
            assert 499 <= later.timestamp - earlier.timestamp <= 3001
    contexts = [calls[0].hash_ids for calls in agents.values()]
    assert max(_common_prefix(a, b) for a, b in itertools.combinations(contexts, 2)) >= 64 // HASH_BLOCK_WORDS
    mean_rate = (len(requests) - 1) / requests[-1].timestamp * 1000
    assert 5.0 < mean_rate < 20.0  # the default 10 per second, drawn


def test_hot_burst_puts_a_burst_on_one_prefix_in_the_middle() -> None:
    requests = _trace("hot-burst")
    hot = [i for i, r in enumerate(requests) if r.session_id == "hot"]
    assert len(hot) == 20 and len(requests) == 80
    assert len({requests[i].messages[0].content for i in hot}) == 1
    window = requests[hot[0] : hot[-1] + 1]
    assert sum(r.session_id == "hot" for r in window) >= 0.8 * len(window)
    assert 0.3 < hot[0] / len(requests) < 0.7
    background = {r.session_id for r in requests} - {"hot"}
    assert background == {f"prefix-{tenant}" for tenant in range(4)}


def _line(**changes: Any) -> str:
    record = {
        "timestamp": 0,
        "session_id": "s",
        "messages": [{"role": "user", "content": "hi"}],
        "output_length": 4,
        "hash_ids": [],
    }
    return json.dumps({key: value for key, value in (record | changes).items() if value is not None})


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([_line(), "{not json"], "t.jsonl line 2: Invalid JSON"),
        ([_line(output_length=None)], "t.jsonl line 1: output_length: Field required"),
        (
            [_line(messages=[{"role": "tool", "content": "x"}])],
            "t.jsonl line 1: messages.0.role: Input should be",
        ),
        (
            [_line(), "", _line(timestamp=-5)],
            "t.jsonl line 3: timestamp: Input should be greater than or equal",
        ),
        ([_line(messages=[])], "t.jsonl line 1: messages: List should have at least 1 item"),
        ([_line(model="x")], "t.jsonl line 1: model: Extra inputs are not permitted"),
        (["", "  "], "t.jsonl holds no requests"),
        ([_line(timestamp=float("inf"))], "t.jsonl line 1: timestamp: Input should be a finite number"),
        (
            [_line(), _line(timestamp=7 * 24 * 3600 * 1000 + 1)],
            "t.jsonl line 2: timestamp: must be at most 604800000 (a week in milliseconds",
        ),
        (
            [_line(output_length=-4)],
            "t.jsonl line 1: output_length: Input should be greater than or equal to 1",
        ),
        (
            [_line(output_length=10**12)],
            "t.jsonl line 1: output_length: must be at most 1048576 (past any model's context window)",
        ),
    ],
    ids=[
        "not-json",
        "missing-field",
        "bad-role",
        "negative-time",
        "no-messages",
        "unknown-field",
        "empty",
        "infinite-time",
        "time-past-a-week",
        "negative-output",
        "absurd-output",
    ],
)
def test_a_malformed_trace_names_the_line(lines: list[str], message: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace(lines, "t.jsonl")
    assert str(caught.value).startswith(message)


def test_a_missing_trace_file_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"cannot read the trace .*herd bench trace"):
        load_trace(tmp_path / "nothing.jsonl")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_line().encode() + b"\n\xff\xfe" + _line().encode(), "line 2: byte 0xff is not UTF-8"),
        (_line().replace('"s"', '"café"').encode("latin-1"), "line 1: byte 0xe9 is not UTF-8"),
    ],
    ids=["binary", "latin-1"],
)
def test_a_trace_that_is_not_utf8_names_the_file_and_line(data: bytes, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path} {message}; a trace is UTF-8 JSONL")


def test_text_with_unicode_line_separators_round_trips(tmp_path: Path) -> None:
    request = TraceRequest.model_validate_json(_line(messages=[{"role": "user", "content": "a\u2028b\x85c"}]))
    dump_trace([request], tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == [request]


def test_the_cli_writes_the_same_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "burst.jsonl"
    options = [
        "--num-requests",
        "60",
        "--num-prefixes",
        "4",
        "--prefix-len",
        "40",
        "--burst-requests",
        "20",
    ]
    assert main(["bench", "trace", "--kind", "hot-burst", "--out", str(out), "--seed", "0", *options]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 80 requests of 5 sessions to {out}"
    assert load_trace(out) == _trace("hot-burst")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--kind", "shared-prefix", "--num-turns", "3"],
            "--num-turns: not a setting of --kind shared-prefix",
        ),
        (["--kind", "multi-turn", "--user-len", "9:1"], "--user-len: a length range needs 0 < LOW <= HIGH"),
        (
            ["--kind", "multi-turn", "--user-len", "1:10000000000"],
            "--user-len: a length must be at most 1048576",
        ),
        (["--kind", "hot-burst", "--burst-at", "2"], "--burst-at: Input should be less than or equal to 1"),
        (
            ["--kind", "shared-prefix", "--request-rate", "0"],
            "--request-rate: Input should be greater than 0",
        ),
        (
            ["--kind", "shared-prefix", "--request-rate", "nan"],
            "--request-rate: Input should be a finite number",
        ),
        (["--kind", "mooncake", "--request-rate", "inf"], "--request-rate: Input should be a finite number"),
        (
            ["--kind", "multi-turn", "--request-rate", "1e-6"],
            "at these arrival rates the trace would span about 1.48e+03 days, and a trace may span at most "
            "a week",
        ),
        (
            ["--kind", "mooncake", "--request-rate", "5e-324"],
            "at these arrival rates the trace would span about inf days",
        ),
        (
            ["--kind", "hot-burst", "--burst-rate", "1e-9"],
            "at these arrival rates the trace would span about 1.48e+06",
        ),
        (
            # An expected span of 5.8 days that this seed's Poisson draw takes past a week.
            [
                "--kind",
                "shared-prefix",
                "--num-groups",
                "1",
                "--prompts-per-group",
                "2",
                "--request-rate",
                "4e-6",
                "--seed",
                "11",
            ],
            "the drawn trace spans 9.4 days, and a trace may span at most a week",
        ),
    ],
    ids=[
        "other-kinds-option",
        "bad-length",
        "absurd-length",
        "out-of-range",
        "zero-rate",
        "nan-rate",
        "infinite-rate",
        "tiny-rate",
        "rate-that-underflows",
        "tiny-burst-rate",
        "drawn-past-a-week",
    ],
)
def test_the_cli_names_the_option_to_fix(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "trace", "--out", str(tmp_path / "t.jsonl"), *options]) == 2
    assert capsys.readouterr().err.startswith(f"herd bench trace: {message}")
    assert not (tmp_path / "t.jsonl").exists()
