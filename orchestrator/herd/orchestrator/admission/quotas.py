"""Per-tenant requests and tokens per minute, counted in fixed one-minute windows shared by replicas.

Each tenant with a quota has two counters per wall-clock minute (``herd:quota:<tenant>:<kind>:<minute>``)
in the ``State`` (a dict, or Redis keys every gateway replica increments, expiring after the
minute): requests, incremented as each request is admitted, and tokens, increased by each answer's
prompt plus output tokens once it is known. A request is refused with 429 when its request would
pass the requests limit, or when the minute's tokens already reached the tokens limit (a request's
own size is not known before it runs, so the last request of a minute may overshoot, as OpenAI's
limits do). Answers carry OpenAI's ``x-ratelimit-*`` headers; a 429 also ``Retry-After``, the time
to the next minute. ``QuotaWindow`` is the pure part (keys, verdicts, headers); ``Quotas`` does the I/O.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Literal, Protocol

from herd.api.errors import HttpError
from herd.orchestrator.admission.tenants import Tenant

__all__ = ["QuotaCounter", "QuotaUse", "QuotaWindow", "Quotas"]

WINDOW_SECONDS = 60
Kind = Literal["requests", "tokens"]


class QuotaCounter(Protocol):
    """Where windows are counted (``herd.orchestrator.state``: in memory, or Redis across replicas)."""

    async def add_to_window(self, key: str, amount: int, ttl_seconds: int) -> int:
        """Add ``amount`` to ``key`` (created with ``ttl_seconds``); its new value."""
        ...


@dataclass(frozen=True, slots=True)
class QuotaUse:
    """A tenant's use of the current window, as one request saw it."""

    tenant: Tenant
    num_requests: int
    num_tokens: int
    reset_seconds: float

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has."""
        quotas = self.tenant.quotas
        reset = f"{math.ceil(self.reset_seconds)}s"
        headers = {}
        for kind, limit, used in (
            ("requests", quotas.requests_per_minute, self.num_requests),
            ("tokens", quotas.tokens_per_minute, self.num_tokens),
        ):
            if limit is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(limit - used, 0))
                headers[f"x-ratelimit-reset-{kind}"] = reset
        return headers

    def exceeded(self) -> Kind | None:
        """Which limit this request is refused by, if any."""
        quotas = self.tenant.quotas
        if quotas.requests_per_minute is not None and self.num_requests > quotas.requests_per_minute:
            return "requests"
        if quotas.tokens_per_minute is not None and self.num_tokens >= quotas.tokens_per_minute:
            return "tokens"
        return None


@dataclass(frozen=True, slots=True)
class QuotaWindow:
    """The window ``now`` (wall-clock seconds, the same on every replica) falls in."""

    now: float

    @property
    def index(self) -> int:
        return int(self.now // WINDOW_SECONDS)

    @property
    def reset_seconds(self) -> float:
        return (self.index + 1) * WINDOW_SECONDS - self.now

    def key(self, tenant: Tenant, kind: Kind) -> str:
        return f"herd:quota:{tenant.name}:{kind}:{self.index}"


class Quotas:
    def __init__(self, counter: QuotaCounter) -> None:
        self.counter = counter
        self._spending: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: Tenant, now: float) -> QuotaUse | None:
        """Count the request against its tenant's quotas (``None`` when it has none); 429 past one."""
        quotas = tenant.quotas
        if quotas.requests_per_minute is None and quotas.tokens_per_minute is None:
            return None
        window = QuotaWindow(now)
        ttl = WINDOW_SECONDS * 2
        num_requests = await self.counter.add_to_window(window.key(tenant, "requests"), 1, ttl)
        num_tokens = await self.counter.add_to_window(window.key(tenant, "tokens"), 0, ttl)
        use = QuotaUse(tenant, num_requests, num_tokens, window.reset_seconds)
        kind = use.exceeded()
        if kind is not None:
            retry_after = str(math.ceil(use.reset_seconds))
            limit = quotas.requests_per_minute if kind == "requests" else quotas.tokens_per_minute
            raise HttpError(
                429,
                f"tenant {tenant.name!r} reached its limit of {limit} {kind} per minute; retry after {retry_after}s",
                headers={**use.headers(), "Retry-After": retry_after},
            )
        return use

    async def spend(self, tenant: Tenant, num_tokens: int, now: float) -> None:
        """Count an answer's tokens (prompt and output) in the window it ended in."""
        if tenant.quotas.tokens_per_minute is None or num_tokens <= 0:
            return
        window = QuotaWindow(now)
        await self.counter.add_to_window(window.key(tenant, "tokens"), num_tokens, WINDOW_SECONDS * 2)

    def spend_soon(self, tenant: Tenant, num_tokens: int, now: float) -> None:
        """``spend`` without waiting for it (an answer's end runs in a synchronous callback)."""
        if tenant.quotas.tokens_per_minute is None or num_tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self.spend(tenant, num_tokens, now))
        self._spending.add(task)
        task.add_done_callback(self._spending.discard)
