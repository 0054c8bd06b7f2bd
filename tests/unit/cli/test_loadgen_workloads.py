"""Load generator workloads: lengths, shared tenant prefixes, growing multi-turn sessions."""

from __future__ import annotations

import pytest

from herd.cli.loadgen.workloads import (
    LengthRange,
    MultiTurnWorkload,
    SharedPrefixWorkload,
    SyntheticWorkload,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256", LengthRange(256, 256)),
        ("16:64", LengthRange(16, 64)),
        ("1:1", LengthRange(1, 1)),
        ("1:1048576", LengthRange(1, 2**20)),
    ],
    ids=["fixed", "range", "one", "longest"],
)
def test_length_range_parses(text: str, expected: LengthRange) -> None:
    assert LengthRange.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "a length must be N or LOW:HIGH"),
        ("abc", "a length must be N or LOW:HIGH"),
        ("1:x", "a length must be N or LOW:HIGH"),
        ("1:2:3", "a length must be N or LOW:HIGH"),
        ("2.5", "a length must be N or LOW:HIGH"),
        ("0", "a length range needs 0 < LOW <= HIGH"),
        ("-5", "a length range needs 0 < LOW <= HIGH"),
        ("64:16", "a length range needs 0 < LOW <= HIGH"),
        ("1048577", "a length must be at most 1048576"),
        ("1:99999999999", "a length must be at most 1048576"),
    ],
    ids=["empty", "word", "bad-high", "three-parts", "fraction", "zero", "negative", "reversed", "too-long",
         "absurd-high"],
)  # fmt: skip
def test_length_range_rejects_nonsense(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        LengthRange.parse(text)
    assert str(caught.value).startswith(message)
    assert str(caught.value).endswith(f"got {text!r}")


def test_synthetic_lengths_stay_in_range_and_repeat_with_the_seed() -> None:
    def draw(seed: int) -> list[tuple[int, int]]:
        workload = SyntheticWorkload(input_len=LengthRange(10, 20), output_len=LengthRange(3, 5), seed=seed)
        specs = [workload.next_request() for _ in range(50)]
        return [(len(spec.messages[0]["content"].split()), spec.max_tokens) for spec in specs]

    lengths = draw(1)
    assert all(10 <= words <= 20 and 3 <= tokens <= 5 for words, tokens in lengths)
    assert len({words for words, _ in lengths}) > 5
    assert draw(1) == lengths
    assert draw(2) != lengths


def test_shared_prefix_tenants_share_their_system_prompt() -> None:
    workload = SharedPrefixWorkload(
        num_tenants=3, prefix_len=100, input_len=LengthRange(8, 8), output_len=LengthRange(4, 4), seed=0
    )
    specs = [workload.next_request() for _ in range(60)]
    systems: dict[int | None, set[str]] = {}
    for spec in specs:
        assert [message["role"] for message in spec.messages] == ["system", "user"]
        systems.setdefault(spec.tenant, set()).add(spec.messages[0]["content"])
    assert set(systems) == {0, 1, 2}
    assert all(len(prompts) == 1 for prompts in systems.values())
    assert len({next(iter(prompts)) for prompts in systems.values()}) == 3
    assert all(len(next(iter(p)).split()) >= 100 for p in systems.values())
    assert len({spec.messages[1]["content"] for spec in specs}) == 60


def test_multi_turn_sessions_grow_and_end_after_their_turns() -> None:
    workload = MultiTurnWorkload(
        num_turns=3,
        session_header="X-Session-ID",
        input_len=LengthRange(5, 5),
        output_len=LengthRange(2, 2),
        seed=0,
    )
    first = workload.next_request()
    concurrent = workload.next_request()
    assert first.session_id != concurrent.session_id
    assert first.headers == {"X-Session-ID": first.session_id}
    workload.complete(first, "reply one")
    second = workload.next_request()
    assert second.session_id == first.session_id
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"] == "reply one"
    workload.complete(second, "reply two")
    third = workload.next_request()
    assert len(third.messages) == 5
    workload.complete(third, "reply three")
    assert workload.next_request().session_id not in {first.session_id, concurrent.session_id}


def test_a_failed_turn_ends_its_session() -> None:
    workload = MultiTurnWorkload(
        num_turns=5,
        session_header="X-Session-ID",
        input_len=LengthRange(5, 5),
        output_len=LengthRange(2, 2),
        seed=0,
    )
    spec = workload.next_request()
    workload.complete(spec, None)
    assert workload.next_request().session_id != spec.session_id
