"""``StreamLedger``: the client gets a resumable stream's events only with their mark, never a mark,
and the resume point names exactly the tokens behind what it got, however the bytes are cut."""

from __future__ import annotations

import json

import pytest

from herd.api.resume import ResumeChoice, ResumeParams, mark, parse_mark
from herd.orchestrator.resume import StreamLedger


def data(index: int, text: str) -> str:
    chunk = {"id": "chatcmpl-x", "created": 1700, "choices": [{"index": index, "delta": {"content": text}}]}
    return f"data: {json.dumps(chunk)}\n\n"


ROLE = data(0, "") + data(1, "")
STREAM = [
    ROLE,
    data(0, "Hel") + mark(0, [11], is_finished=False),
    mark(1, [21], is_finished=False),  # held-back text: a mark with no event
    data(1, "Wor") + mark(1, [22], is_finished=False),
    data(0, "lo") + data(0, "") + mark(0, [12], is_finished=True),
    data(1, "ld") + mark(1, [23, 24], is_finished=True),
    'data: {"id": "chatcmpl-x", "created": 1700, "choices": [], "usage": {}}\n\n',
    "data: [DONE]\n\n",
]
WHOLE = "".join(STREAM).encode()
WITHOUT_MARKS = "".join(part for part in "".join(STREAM).split("\n\n") if part and not part.startswith(":"))


def fed(ledger: StreamLedger, payload: bytes, cut: int) -> bytes:
    return b"".join(ledger.feed(payload[i : i + cut]) for i in range(0, len(payload), cut))


@pytest.mark.parametrize("cut", [1, 7, 64, len(WHOLE)], ids=lambda cut: f"chunks-of-{cut}")
def test_a_complete_stream_reaches_the_client_whole_without_its_marks(cut: int) -> None:
    ledger = StreamLedger()
    sent = fed(ledger, WHOLE, cut) + ledger.flush()
    assert sent.decode().replace("\n\n", "") == WITHOUT_MARKS
    assert b"herd-mark" not in sent
    assert ledger.resume_params() == ResumeParams(
        created=1700,
        choices=[
            ResumeChoice(index=0, token_ids=[11, 12], is_finished=True),
            ResumeChoice(index=1, token_ids=[21, 22, 23, 24], is_finished=True),
        ],
    )


@pytest.mark.parametrize(
    ("parts", "expected_text", "expected"),
    [
        (0, "", ResumeParams(created=None, choices=[])),
        (1, "", ResumeParams(created=None, choices=[])),  # role chunks wait for the first mark
        (2, "Hel", ResumeParams(created=1700, choices=[ResumeChoice(index=0, token_ids=[11])])),
        (
            4,
            "HelWor",
            ResumeParams(
                created=1700,
                choices=[ResumeChoice(index=0, token_ids=[11]), ResumeChoice(index=1, token_ids=[21, 22])],
            ),
        ),
        (
            5,
            "HelWorlo",
            ResumeParams(
                created=1700,
                choices=[
                    ResumeChoice(index=0, token_ids=[11, 12], is_finished=True),
                    ResumeChoice(index=1, token_ids=[21, 22]),
                ],
            ),
        ),
    ],
    ids=["nothing", "role-only", "one-token", "both-choices", "one-finished"],
)
def test_a_broken_stream_resumes_from_what_its_client_has(
    parts: int, expected_text: str, expected: ResumeParams
) -> None:
    ledger = StreamLedger()
    payload = "".join(STREAM[:parts]).encode()
    cut_mid_event = payload + data(0, "never sent").encode()[:20]
    sent = fed(ledger, cut_mid_event, 5)
    texts = [
        choice["delta"].get("content", "")
        for line in sent.decode().split("\n\n")
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
    ]
    assert "".join(texts) == expected_text
    assert ledger.resume_params() == expected


@pytest.mark.parametrize(
    "event",
    [b": herd-mark [0, [1, 2], 0", b": herd-mark {}", b': herd-mark [0, ["a"], 1]', b": other comment"],
    ids=["truncated", "not-a-list", "not-ids", "other-comment"],
)
def test_what_is_not_a_mark_reads_as_none(event: bytes) -> None:
    assert parse_mark(event) is None


def test_a_mark_reads_back_as_written() -> None:
    written = mark(3, [5, 6, 7], is_finished=True).encode().removesuffix(b"\n\n")
    found = parse_mark(written)
    assert found is not None and (found.index, found.token_ids, found.is_finished) == (3, (5, 6, 7), True)
