"""Workloads: what ``herd bench`` asks for, one request at a time.

A workload hands out ``RequestSpec``s (``next_request``) and hears back how each ended
(``complete``), so stateful workloads such as multi-turn chat can grow a conversation. Prompt
lengths are counted in words drawn from a small vocabulary of short, common English words, which
common BPE tokenizers map to about one token each (the server's ``usage`` has the exact counts).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

__all__ = [
    "MAX_LENGTH",
    "MAX_SPAN_S",
    "LengthRange",
    "Message",
    "MultiTurnWorkload",
    "RequestSpec",
    "SharedPrefixWorkload",
    "SyntheticWorkload",
    "TraceWorkload",
    "Workload",
    "random_text",
]

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part"
)
_WORDS = _WORD_TEXT.split()

Message = dict[str, str]

MAX_LENGTH = 2**20
"""The longest length (words, tokens or milliseconds) ``herd bench`` takes: about a million, past any
served model's context window. herd's API sets no bound on ``max_tokens``; a longer length is a typo,
and its prompts alone would take gigabytes to build."""

MAX_SPAN_S = 7 * 24 * 3600
"""The longest a trace may span, or a run paced by a request rate may be expected to last: a week.
Longer comes from a mistyped rate or count, and would make a run that never ends in practice."""


def random_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` random common words: text that tokenizes to about one token per word."""
    return " ".join(rng.choices(_WORDS, k=num_words))


@dataclass(frozen=True, slots=True)
class LengthRange:
    """A length drawn uniformly from ``[low, high]`` (parsed from ``"256"`` or ``"128:512"``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, _, high = text.partition(":")
        try:
            bounds = cls(int(low), int(high or low))
        except ValueError:
            raise ValueError(f"a length must be N or LOW:HIGH (integers), got {text!r}") from None
        if not 0 < bounds.low <= bounds.high:
            raise ValueError(f"a length range needs 0 < LOW <= HIGH, got {text!r}")
        if bounds.high > MAX_LENGTH:
            raise ValueError(
                f"a length must be at most {MAX_LENGTH} (past any model's context window), got {text!r}"
            )
        return bounds

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(slots=True)
class RequestSpec:
    """One request to send: the chat messages (a completion prompt joins them), its output budget,
    and for multi-turn chat its session."""

    messages: list[Message]
    max_tokens: int
    session_id: str | None = None
    tenant: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


class Workload(ABC):
    name: str

    @abstractmethod
    def next_request(self) -> RequestSpec:
        """The next request to send."""

    def complete(self, spec: RequestSpec, reply: str | None) -> None:
        """How a request ended: the reply text, or ``None`` on an error. Stateless by default."""
        return

    def arrival_gap_s(self, rng: random.Random, rate: float) -> float:
        """Seconds from one arrival to the next at ``rate`` per second: Poisson by default."""
        return rng.expovariate(rate)


class _RandomWorkload(Workload):
    """A workload drawn from a seeded generator: prompt and output lengths from ranges."""

    def __init__(self, *, input_len: LengthRange, output_len: LengthRange, seed: int) -> None:
        self.input_len = input_len
        self.output_len = output_len
        self.rng = random.Random(seed)

    def _user_turn(self) -> Message:
        return {"role": "user", "content": random_text(self.rng, self.input_len.draw(self.rng))}


class SyntheticWorkload(_RandomWorkload):
    """Independent prompts of random words."""

    name = "synthetic"

    def next_request(self) -> RequestSpec:
        return RequestSpec(messages=[self._user_turn()], max_tokens=self.output_len.draw(self.rng))


class SharedPrefixWorkload(_RandomWorkload):
    """Multi-tenant: each tenant has a long system prompt that all its requests share."""

    name = "shared-prefix"

    def __init__(
        self, *, num_tenants: int, prefix_len: int, input_len: LengthRange, output_len: LengthRange, seed: int
    ) -> None:
        super().__init__(input_len=input_len, output_len=output_len, seed=seed)
        self.system_prompts = [
            f"You are the assistant of tenant {tenant}. "
            + random_text(random.Random(seed * 7919 + tenant), prefix_len)
            for tenant in range(num_tenants)
        ]

    def next_request(self) -> RequestSpec:
        tenant = self.rng.randrange(len(self.system_prompts))
        system: Message = {"role": "system", "content": self.system_prompts[tenant]}
        return RequestSpec(
            messages=[system, self._user_turn()], max_tokens=self.output_len.draw(self.rng), tenant=tenant
        )


@dataclass(slots=True)
class _Session:
    session_id: str
    messages: list[Message]
    turns_left: int
    is_busy: bool = False


class MultiTurnWorkload(_RandomWorkload):
    """Chat sessions of ``num_turns`` turns: each turn resends the whole conversation plus a new user
    message, under the session's id in ``session_header``. A session has one turn in flight at a time;
    when every open session is busy, a new one starts."""

    name = "multi-turn"

    def __init__(
        self,
        *,
        num_turns: int,
        session_header: str,
        input_len: LengthRange,
        output_len: LengthRange,
        seed: int,
    ) -> None:
        super().__init__(input_len=input_len, output_len=output_len, seed=seed)
        self.num_turns = num_turns
        self.session_header = session_header
        self.sessions: dict[str, _Session] = {}
        self._num_started = 0

    def next_request(self) -> RequestSpec:
        session = next((s for s in self.sessions.values() if not s.is_busy), None) or self._start_session()
        session.is_busy = True
        session.turns_left -= 1
        session.messages.append(self._user_turn())
        return RequestSpec(
            messages=list(session.messages),
            max_tokens=self.output_len.draw(self.rng),
            session_id=session.session_id,
            headers={self.session_header: session.session_id},
        )

    def complete(self, spec: RequestSpec, reply: str | None) -> None:
        session = self.sessions.get(spec.session_id or "")
        if session is None:
            return
        session.is_busy = False
        session.messages.append({"role": "assistant", "content": reply or ""})
        if session.turns_left <= 0 or reply is None:
            del self.sessions[session.session_id]

    def _start_session(self) -> _Session:
        self._num_started += 1
        session_id = f"session-{self.rng.getrandbits(32):08x}-{self._num_started}"
        session = _Session(session_id=session_id, messages=[], turns_left=self.num_turns)
        self.sessions[session_id] = session
        return session


class TraceWorkload(Workload):
    """Replays a trace's requests in order, except that a request extending an earlier one of its
    session (a later turn, an agent's next call) waits for that one's answer, as a user reads the
    answer before the next turn: the next ready request goes first. A tenant's independent requests
    never wait; when no remaining request is ready, the first goes anyway. Paced by a request rate, it
    keeps the trace's own arrival gaps scaled so that their mean rate is the one asked for (bursts
    stay bursts)."""

    name = "trace"

    def __init__(self, specs: list[RequestSpec], timestamps_ms: list[int]) -> None:
        self.specs = specs
        self.timestamps_ms = timestamps_ms
        self._unsent = list(range(len(specs)))
        self._extends = _extended_requests(specs)
        self._answered: set[int] = set()
        self._index = {id(spec): index for index, spec in enumerate(specs)}
        self._num_arrived = 0

    def next_request(self) -> RequestSpec:
        if not self._unsent:
            raise RuntimeError(
                f"the trace has only {len(self.specs)} requests: ask for at most that many (--num-requests)"
            )
        index = next((i for i in self._unsent if self._is_ready(i)), self._unsent[0])
        self._unsent.remove(index)
        return self.specs[index]

    def complete(self, spec: RequestSpec, reply: str | None) -> None:
        self._answered.add(self._index[id(spec)])

    def _is_ready(self, index: int) -> bool:
        extended = self._extends[index]
        return extended is None or extended in self._answered

    def arrival_gap_s(self, rng: random.Random, rate: float) -> float:
        span_ms = self.timestamps_ms[-1] - self.timestamps_ms[0]
        if span_ms <= 0:  # every request at once: one arrival per 1/rate
            return 1 / rate
        self._num_arrived += 1
        index = min(self._num_arrived, len(self.timestamps_ms) - 1)
        gap_ms = self.timestamps_ms[index] - self.timestamps_ms[index - 1]
        trace_rate = (len(self.timestamps_ms) - 1) / span_ms * 1000
        return gap_ms / 1000 * trace_rate / rate


def _extended_requests(specs: list[RequestSpec]) -> list[int | None]:
    """For each request, the previous request of its session if it extends that one's messages."""
    latest: dict[str | None, int] = {}
    extends: list[int | None] = []
    for index, spec in enumerate(specs):
        previous = latest.get(spec.session_id)
        prior = [] if previous is None else specs[previous].messages
        extends.append(previous if prior and spec.messages[: len(prior)] == prior else None)
        latest[spec.session_id] = index
    return extends
