"""Request traces: generated deterministically from a seed, saved as JSONL, replayed by any harness.

One JSON object per line, one request each, with everything a replay needs and nothing that depends
on a server (the field names follow Mooncake's traces and aiperf's ``mooncake_trace`` records):

    {"timestamp": 1250, "session_id": "group-3", "messages": [{"role": "system", "content": "..."},
     {"role": "user", "content": "..."}], "output_length": 256, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival offset in milliseconds, at most a week (``MAX_SPAN_S``; lines are in
arrival order); ``output_length`` is the request's ``max_tokens``, at most ``MAX_LENGTH``. The file
is UTF-8. A multi-turn session's later requests carry its earlier turns in full, with assistant
text fixed by the trace, so every prompt is known before the run. ``hash_ids`` name the request's
blocks of ``HASH_BLOCK_WORDS`` words of message text (each role opens with one
marker word), chained like KV block hashes: two requests share their first ``k`` ids exactly when
their first ``k`` blocks are the same text, so any harness can see the sharing without a tokenizer.
Text is made of the load generator's common words (about one token each); the exact token counts
come from the model's tokenizer (``herd bench oracle``).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from herd.cli.loadgen.problems import first_problem
from herd.cli.loadgen.workloads import (
    MAX_LENGTH,
    MAX_SPAN_S,
    LengthRange,
    Message,
    RequestSpec,
    TraceWorkload,
    random_text,
)

__all__ = [
    "HASH_BLOCK_WORDS",
    "TRACE_KINDS",
    "TRACE_SPEC",
    "HotBurstTrace",
    "MooncakeTrace",
    "MultiTurnTrace",
    "SharedPrefixTrace",
    "TraceError",
    "TraceMessage",
    "TraceRequest",
    "TraceSpec",
    "dump_trace",
    "generate",
    "load_trace",
    "parse_trace",
    "trace_workload",
]

HASH_BLOCK_WORDS = 16
"""Words per ``hash_ids`` block (herd's KV block is 16 tokens, and a word is about one token)."""

_MAX_SPAN_MS = MAX_SPAN_S * 1000


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and the line."""


class TraceMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


def _at_most(limit: int, why: str) -> AfterValidator:
    def check(value: int) -> int:
        if value > limit:
            raise ValueError(f"must be at most {limit} ({why})")
        return value

    return AfterValidator(check)


class TraceRequest(BaseModel):
    """One line of a trace."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timestamp: Annotated[
        int, _at_most(_MAX_SPAN_MS, "a week in milliseconds, the longest trace herd takes")
    ] = Field(ge=0, description="Arrival offset from the trace's start, in milliseconds.")
    session_id: str = Field(
        description="The session (multi-turn, agent) or tenant (shared prefix) of the request."
    )
    messages: list[TraceMessage] = Field(min_length=1)
    output_length: Annotated[int, _at_most(MAX_LENGTH, "past any model's context window")] = Field(
        ge=1, description="max_tokens of the request."
    )
    hash_ids: list[int] = Field(description="Ids of the request's text blocks, shared where the text is.")


def _check_length(text: str) -> str:
    LengthRange.parse(text)
    return text


Length = Annotated[str, AfterValidator(_check_length)]
"""A length in words: ``N`` or ``LOW:HIGH`` (drawn uniformly)."""


def _range(length: str) -> LengthRange:
    return LengthRange.parse(length)


@dataclass(slots=True)
class _Draft:
    """A request before the arrival sort and the hash ids."""

    arrival_ms: float
    session_id: str
    messages: list[Message]
    output_length: int


class _TraceKind(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_rate: float = Field(
        default=10.0, gt=0, allow_inf_nan=False, description="mean arrivals per second (the timestamps)"
    )

    @model_validator(mode="after")
    def _check_span(self) -> Self:
        # Checked before drawing: at a tiny rate the draws overflow to infinity (or, for mooncake's
        # sessions, divide by a rate that rounds to zero).
        span_s = self._expected_span_s()
        if span_s > MAX_SPAN_S:
            rates = " or ".join(
                "--" + name.replace("_", "-") for name in type(self).model_fields if name.endswith("_rate")
            )
            raise ValueError(
                f"at these arrival rates the trace would span about {span_s / 86_400:.3g} days, and a trace "
                f"may span at most a week (so that a replay ends): raise {rates} or ask for fewer requests"
            )
        return self

    @abstractmethod
    def _expected_span_s(self) -> float:
        """The mean time from the first arrival to the last, in seconds."""

    def _arrive(
        self, drafts: list[_Draft], rng: random.Random, start_ms: float = 0.0, rate: float = 0.0
    ) -> list[_Draft]:
        """Give ``drafts``, in order, Poisson arrivals from ``start_ms`` at ``rate`` per second
        (default: ``request_rate``); returns them."""
        now = start_ms
        for draft in drafts:
            draft.arrival_ms = now
            now += rng.expovariate(rate or self.request_rate) * 1000
        return drafts


def _ask(session_id: str, system: str, question_words: int, output_length: int, rng: random.Random) -> _Draft:
    messages: list[Message] = [
        {"role": "system", "content": system},
        {"role": "user", "content": random_text(rng, question_words)},
    ]
    return _Draft(0.0, session_id, messages, output_length)


def _turn(history: list[Message], user_words: int, output_length: int, rng: random.Random) -> list[Message]:
    """The messages of the next turn; ``history`` grows by the turn and its fixed answer."""
    history.append({"role": "user", "content": random_text(rng, user_words)})
    messages = list(history)
    history.append({"role": "assistant", "content": random_text(rng, output_length)})
    return messages


class SharedPrefixTrace(_TraceKind):
    """SGLang's generated shared prefix: ``num_groups`` system prompts, each asked
    ``prompts_per_group`` distinct questions, in a seeded random order."""

    kind: Literal["shared-prefix"] = "shared-prefix"
    num_groups: int = Field(default=64, ge=1, description="groups (system prompts)")
    prompts_per_group: int = Field(default=16, ge=1, description="questions per group")
    system_prompt_len: int = Field(default=2048, ge=1, description="system prompt words")
    question_len: int = Field(default=128, ge=1, description="question words")
    output_len: int = Field(default=256, ge=1, description="max_tokens of every request")

    def _expected_span_s(self) -> float:
        return self.num_groups * self.prompts_per_group / self.request_rate

    def drafts(self, rng: random.Random) -> list[_Draft]:
        systems = [random_text(rng, self.system_prompt_len) for _ in range(self.num_groups)]
        drafts = [
            _ask(f"group-{group}", system, self.question_len, self.output_len, rng)
            for group, system in enumerate(systems)
            for _ in range(self.prompts_per_group)
        ]
        rng.shuffle(drafts)
        return self._arrive(drafts, rng)


class MultiTurnTrace(_TraceKind):
    """Chat sessions that resend their history: every session's turn ``k`` comes before any turn
    ``k + 1``, the sessions in a fresh random order each round, so a session's turns are about
    ``num_sessions`` requests apart."""

    kind: Literal["multi-turn"] = "multi-turn"
    num_sessions: int = Field(default=32, ge=1, description="chat sessions")
    num_turns: int = Field(default=4, ge=1, description="turns per session")
    user_len: Length = Field(default="64", description="words per user turn: N or LOW:HIGH")
    output_len: Length = Field(default="128", description="max_tokens (and answer words): N or LOW:HIGH")

    def _expected_span_s(self) -> float:
        return self.num_sessions * self.num_turns / self.request_rate

    def drafts(self, rng: random.Random) -> list[_Draft]:
        user_len, output_len = _range(self.user_len), _range(self.output_len)
        histories: list[list[Message]] = [[] for _ in range(self.num_sessions)]
        drafts = []
        for _ in range(self.num_turns):
            for session in rng.sample(range(self.num_sessions), self.num_sessions):
                output_length = output_len.draw(rng)
                messages = _turn(histories[session], user_len.draw(rng), output_length, rng)
                drafts.append(_Draft(0.0, f"session-{session}", messages, output_length))
        return self._arrive(drafts, rng)


class MooncakeTrace(_TraceKind):
    """Mooncake's shape (arrival times, input and output lengths, shared prefix blocks), generated:
    sessions arrive as a Poisson process; a ``agent_share`` of them are tool agents that work on one of
    ``num_apps`` long shared contexts (system prompt and tool definitions) and call the model
    ``tool_calls`` times, each call resending the context, the task and every earlier call and tool
    result; the rest are chats of ``chat_turns`` turns. Timestamps interleave the sessions."""

    kind: Literal["mooncake"] = "mooncake"
    num_requests: int = Field(default=512, ge=1, description="requests in the trace")
    num_apps: int = Field(default=4, ge=1, description="tool-agent applications (shared contexts)")
    app_context_len: int = Field(default=1024, ge=1, description="words of each application's context")
    agent_share: float = Field(default=0.6, ge=0, le=1, description="share of sessions that are tool agents")
    tool_calls: Length = Field(default="4:12", description="model calls per agent session")
    task_len: Length = Field(default="32:64", description="words of an agent's task")
    tool_result_len: Length = Field(default="64:256", description="words of one tool result")
    agent_gap_ms: Length = Field(default="500:3000", description="ms between an agent's calls")
    chat_turns: Length = Field(default="1:4", description="turns per chat session")
    chat_len: Length = Field(default="32:256", description="words per chat user turn")
    chat_gap_ms: Length = Field(default="5000:20000", description="ms between a chat's turns")
    output_len: Length = Field(default="16:128", description="max_tokens (and answer words)")

    def _expected_span_s(self) -> float:
        return self.num_requests / self.request_rate

    def drafts(self, rng: random.Random) -> list[_Draft]:
        contexts = [random_text(rng, self.app_context_len) for _ in range(self.num_apps)]
        session_rate = self.request_rate / self._mean_requests_per_session()
        drafts: list[_Draft] = []
        start_ms, cutoff_ms, num_sessions = 0.0, float("inf"), 0
        # Sessions keep arriving until a new one could no longer place a request among the first
        # num_requests arrivals, so the cut below leaves no gap.
        while start_ms < cutoff_ms:
            if rng.random() < self.agent_share:
                calls, gap_ms, name = self._agent(contexts, rng), self.agent_gap_ms, "agent"
            else:
                calls, gap_ms, name = self._chat(rng), self.chat_gap_ms, "chat"
            drafts += _place(calls, f"{name}-{num_sessions}", start_ms, _range(gap_ms), rng)
            num_sessions += 1
            start_ms += rng.expovariate(session_rate) * 1000
            if len(drafts) >= self.num_requests:
                cutoff_ms = sorted(d.arrival_ms for d in drafts)[self.num_requests - 1]
        return sorted(drafts, key=lambda d: d.arrival_ms)[: self.num_requests]

    def _mean_requests_per_session(self) -> float:
        calls, turns = _range(self.tool_calls), _range(self.chat_turns)
        mean_calls, mean_turns = (calls.low + calls.high) / 2, (turns.low + turns.high) / 2
        return self.agent_share * mean_calls + (1 - self.agent_share) * mean_turns

    def _agent(self, contexts: Sequence[str], rng: random.Random) -> list[tuple[list[Message], int]]:
        task = random_text(rng, _range(self.task_len).draw(rng))
        history: list[Message] = [
            {"role": "system", "content": rng.choice(contexts)},
            {"role": "user", "content": task},
        ]
        calls = []
        for _ in range(_range(self.tool_calls).draw(rng)):
            output_length = _range(self.output_len).draw(rng)
            calls.append((list(history), output_length))
            result = random_text(rng, _range(self.tool_result_len).draw(rng))
            history += [
                {"role": "assistant", "content": random_text(rng, output_length)},
                {"role": "user", "content": f"tool result: {result}"},
            ]
        return calls

    def _chat(self, rng: random.Random) -> list[tuple[list[Message], int]]:
        history: list[Message] = []
        turns = []
        for _ in range(_range(self.chat_turns).draw(rng)):
            output_length = _range(self.output_len).draw(rng)
            user_words = _range(self.chat_len).draw(rng)
            turns.append((_turn(history, user_words, output_length, rng), output_length))
        return turns


def _place(
    calls: list[tuple[list[Message], int]],
    session_id: str,
    start_ms: float,
    gap_ms: LengthRange,
    rng: random.Random,
) -> list[_Draft]:
    """A session's requests from ``start_ms`` on, ``gap_ms`` apart."""
    drafts, now = [], start_ms
    for messages, output_length in calls:
        drafts.append(_Draft(now, session_id, messages, output_length))
        now += gap_ms.draw(rng)
    return drafts


class HotBurstTrace(_TraceKind):
    """A background of requests spread over ``num_prefixes`` shared prefixes, and in its middle a
    burst of ``burst_requests`` requests on one hot prefix arriving at ``burst_rate`` per second."""

    kind: Literal["hot-burst"] = "hot-burst"
    num_requests: int = Field(default=512, ge=1, description="background requests (the burst comes on top)")
    num_prefixes: int = Field(default=16, ge=1, description="background prefixes (tenants)")
    prefix_len: int = Field(default=512, ge=1, description="words of every prefix")
    question_len: int = Field(default=64, ge=1, description="question words")
    output_len: int = Field(default=64, ge=1, description="max_tokens of every request")
    burst_requests: int = Field(default=128, ge=1, description="requests in the burst")
    burst_at: float = Field(
        default=0.5, ge=0, le=1, description="where the burst starts, as a share of the background"
    )
    burst_rate: float = Field(
        default=100.0, gt=0, allow_inf_nan=False, description="burst arrivals per second"
    )

    def _expected_span_s(self) -> float:
        return self.num_requests / self.request_rate + self.burst_requests / self.burst_rate

    def drafts(self, rng: random.Random) -> list[_Draft]:
        prefixes = [random_text(rng, self.prefix_len) for _ in range(self.num_prefixes + 1)]
        background = [
            _ask(f"prefix-{tenant}", prefixes[tenant], self.question_len, self.output_len, rng)
            for tenant in (rng.randrange(self.num_prefixes) for _ in range(self.num_requests))
        ]
        self._arrive(background, rng)
        burst_start = background[
            min(int(self.burst_at * self.num_requests), self.num_requests - 1)
        ].arrival_ms
        burst = [
            _ask("hot", prefixes[-1], self.question_len, self.output_len, rng)
            for _ in range(self.burst_requests)
        ]
        self._arrive(burst, rng, burst_start, self.burst_rate)
        return background + burst


TRACE_KINDS = (SharedPrefixTrace, MultiTurnTrace, MooncakeTrace, HotBurstTrace)
TraceSpec = Annotated[
    SharedPrefixTrace | MultiTurnTrace | MooncakeTrace | HotBurstTrace, Field(discriminator="kind")
]
TRACE_SPEC: TypeAdapter[TraceSpec] = TypeAdapter(TraceSpec)
"""Validates ``{"kind": ..., **options}`` into the kind's settings."""


def generate(spec: TraceSpec, seed: int) -> list[TraceRequest]:
    """The trace ``spec`` describes, in arrival order: the same ``seed`` gives the same requests."""
    drafts = sorted(spec.drafts(random.Random(seed)), key=lambda d: d.arrival_ms)
    blocks = _HashIds()
    start = drafts[0].arrival_ms
    span_ms = drafts[-1].arrival_ms - start
    # The rates passed _check_span, but Poisson tails and long session gaps can still draw past it.
    if span_ms > _MAX_SPAN_MS:
        raise ValueError(
            f"the drawn trace spans {span_ms / 86_400_000:.3g} days, and a trace may span at most a week "
            "(so that a replay ends): raise --request-rate, shorten the gaps between a session's requests "
            "or ask for fewer requests"
        )
    return [
        TraceRequest(
            timestamp=round(draft.arrival_ms - start),
            session_id=draft.session_id,
            messages=[TraceMessage(**message) for message in draft.messages],
            output_length=draft.output_length,
            hash_ids=blocks.ids(draft.messages),
        )
        for draft in drafts
    ]


class _HashIds:
    """Numbers blocks of words in order of first appearance; a block's id depends on its parent's."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[str, ...]], int] = {}

    def ids(self, messages: Iterable[Message]) -> list[int]:
        words = [word for m in messages for word in [f"<{m['role']}>", *m["content"].split()]]
        ids, parent = [], -1
        for start in range(0, len(words) - HASH_BLOCK_WORDS + 1, HASH_BLOCK_WORDS):
            parent = self._ids.setdefault(
                (parent, tuple(words[start : start + HASH_BLOCK_WORDS])), len(self._ids)
            )
            ids.append(parent)
        return ids


def dump_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for request in requests:
            out.write(request.model_dump_json() + "\n")


def parse_trace(lines: Iterable[str], source: str) -> list[TraceRequest]:
    """The requests of a trace's lines; a malformed line raises ``TraceError`` naming it."""
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            requests.append(TraceRequest.model_validate_json(line))
        except ValidationError as error:
            raise TraceError(
                f"{source} line {number}: {first_problem(error)}; every line must be one request object "
                "as `herd bench trace` writes it (timestamp, session_id, messages, output_length, hash_ids)"
            ) from None
    if not requests:
        raise TraceError(f"{source} holds no requests: generate one with `herd bench trace`")
    return requests


def load_trace(path: Path) -> list[TraceRequest]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TraceError(
            f"cannot read the trace {path}: {error.strerror}; write one with `herd bench trace`"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TraceError(
            f"{path} line {line}: byte {data[error.start]:#04x} is not UTF-8; a trace is UTF-8 JSONL "
            "as `herd bench trace` writes it: convert the file (iconv -t UTF-8) or write it again"
        ) from None
    # Only "\n" ends a line: str.splitlines would also cut at U+2028 and the like, which JSON strings
    # may hold unescaped.
    return parse_trace(text.split("\n"), str(path))


def trace_workload(requests: Sequence[TraceRequest], session_header: str) -> TraceWorkload:
    """The workload that replays ``requests`` in order, each under its session's header."""
    specs = [
        RequestSpec(
            messages=[message.model_dump() for message in request.messages],
            max_tokens=request.output_length,
            session_id=request.session_id,
            headers={session_header: request.session_id},
        )
        for request in requests
    ]
    return TraceWorkload(specs, [request.timestamp for request in requests])
