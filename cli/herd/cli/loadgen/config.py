"""``BenchConfig``: every setting of one ``herd bench`` run, validated once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from herd.cli.loadgen.problems import problem_message
from herd.cli.loadgen.traces import TraceError, load_trace, trace_workload
from herd.cli.loadgen.workloads import (
    MAX_SPAN_S,
    LengthRange,
    MultiTurnWorkload,
    SharedPrefixWorkload,
    SyntheticWorkload,
    Workload,
)

__all__ = ["BenchConfig", "describe_errors", "parse_extra_body"]


class BenchConfig(BaseModel):
    """Where to send, what, and how hard. Rate mode (``request_rate``) sends Poisson arrivals,
    capped at ``concurrency`` in flight if both are given; otherwise ``concurrency`` requests are
    kept in flight. The run ends after ``num_requests`` or ``duration_s``, whichever comes first.
    The ``trace`` workload replays a saved trace (``herd bench trace``) in order, a conversation's next
    turn after its previous one's answer; paced by ``request_rate`` it keeps the trace's arrival
    gaps, scaled to that mean rate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="Base URL of the OpenAI API, e.g. http://127.0.0.1:8000")
    model: str | None = Field(default=None, description="The `model` field; default: the first served.")
    api: Literal["chat", "completions"] = "chat"
    workload: Literal["synthetic", "shared-prefix", "multi-turn", "trace"] = "synthetic"
    trace: Path | None = Field(default=None, description="The JSONL trace the `trace` workload replays.")
    input_len: str = "256"
    output_len: str = "64"
    num_tenants: int = Field(default=8, ge=1)
    prefix_len: int = Field(default=512, ge=1)
    num_turns: int = Field(default=4, ge=1)
    session_header: str = "X-Session-ID"
    concurrency: int | None = Field(default=None, ge=1)
    request_rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    num_requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    ignore_eos: bool = True
    include_usage: bool = True
    extra_body: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    timeout_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    seed: int = 0

    @field_validator("input_len", "output_len")
    @classmethod
    def _check_length(cls, value: str) -> str:
        LengthRange.parse(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give --concurrency N or --request-rate R (requests per second)")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests N or --duration SECONDS")
        if (self.workload == "trace") != (self.trace is not None):
            raise ValueError("--workload trace replays --trace FILE.jsonl: give both or neither")
        self._check_paced_span()
        return self

    def _check_paced_span(self) -> None:
        """Refuse a rate so low that the requests asked for would take past a week to send (a run that
        never ends in practice); a ``duration_s`` ends the run by itself."""
        if self.request_rate is None or self.num_requests is None or self.duration_s is not None:
            return
        span_s = self.num_requests / self.request_rate
        if span_s > MAX_SPAN_S:
            raise ValueError(
                f"--request-rate {self.request_rate:g}: {self.num_requests} requests would take about "
                f"{span_s / 86_400:.3g} days to send, past the week a paced run may last: "
                "raise --request-rate, lower --num-requests or end the run with --duration"
            )

    @property
    def base_url(self) -> str:
        """The URL without a trailing ``/v1`` (paths are added with it)."""
        url = self.url.rstrip("/")
        return url.removesuffix("/v1")

    def build_workload(self) -> Workload:
        """The workload to run; raises ``TraceError`` for a trace that cannot be replayed."""
        lengths = {
            "input_len": LengthRange.parse(self.input_len),
            "output_len": LengthRange.parse(self.output_len),
        }
        match self.workload:
            case "synthetic":
                return SyntheticWorkload(**lengths, seed=self.seed)
            case "shared-prefix":
                return SharedPrefixWorkload(
                    num_tenants=self.num_tenants, prefix_len=self.prefix_len, **lengths, seed=self.seed
                )
            case "multi-turn":
                return MultiTurnWorkload(
                    num_turns=self.num_turns, session_header=self.session_header, **lengths, seed=self.seed
                )
            case "trace":
                return self._trace_workload()

    def _trace_workload(self) -> Workload:
        if self.trace is None:  # the validator refuses this; here for the type checker
            raise TraceError("--workload trace replays --trace FILE.jsonl: give the file")
        return trace_workload(load_trace(self.trace), self.session_header)


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object merged into every request body."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--extra-body must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {type(value).__name__}")
    return value


def describe_errors(error: ValidationError) -> list[str]:
    """One line per problem, naming the command-line option (never echoing the input: it may hold a key)."""
    lines = []
    for problem in error.errors(include_input=False, include_url=False):
        message = problem_message(problem)
        if problem["loc"]:
            option = "--" + str(problem["loc"][0]).removesuffix("_s").replace("_", "-")
            message = f"{option}: {message}"
        lines.append(message)
    return lines
