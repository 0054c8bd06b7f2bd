"""Where a pulled request's TTFT goes, on one cell of ``bench/kv_tiers.py``'s simulated fleet.

Runs ``host`` and ``host+pulls`` on the cell (trace, open-loop load as a share of ``none``'s
closed-loop throughput, seed; 0 for the closed loop) with the benchmark's own shape, and for
``host+pulls`` splits each pulled request's TTFT into the lease's wait for the peer's step (and its
restores), the bytes, the wait for the puller's step to end, and landing to first token; it also
counts the pulled requests among the slowest 5 %. Simulated ms (deterministic, so the machine's
load changes the wall time only). From ``bench/``:

    ../.venv/bin/python kv_tiers_pull_tail.py tenants 0.8 0
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import kv_tiers as kt
from routing_sim import Request, Shape

from herd.api.prompt import PromptRenderer


def _quantiles(values: list[float]) -> list[int]:
    """p50, p90 and p99, rounded."""
    ordered = sorted(values)
    return [round(ordered[int(share * (len(ordered) - 1))]) for share in (0.5, 0.9, 0.99)]


class _Traced(kt.TierSimulation):
    """``TierSimulation`` keeping each landed pull, and when it landed, by request number."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.landed: dict[int, tuple[kt.Pull, float]] = {}
        self.measured: list[Request] = []

    def _land(self, pull: kt.Pull) -> None:
        self.landed[pull.request.number] = (pull, self.now)
        super()._land(pull)

    def _summary(self, measured: list[Request]) -> dict[str, Any]:
        self.measured = measured
        return super()._summary(measured)


@dataclass(frozen=True)
class PulledRequest:
    """One pulled request's TTFT in its parts, simulated ms: they add up to ``ttft``."""

    lease_wait: float
    """From the pull's decision to the lease, taken when the peer's step in progress ended."""
    bytes: float
    """The blocks crossing at the profile's pull rate."""
    puller_step: float
    """The wait for the puller's step in progress to end, before the request is queued."""
    landing_to_first_token: float
    ttft: float


def pulled_requests(sim: _Traced) -> tuple[list[PulledRequest], list[float], int]:
    """Of a run's measured requests: the pulled ones in their parts, the others' TTFTs, and how many
    pulled ones are among the slowest 5 %."""
    ttft = {r.number: (r.first_token_ms or 0.0) - r.sent_ms for r in sim.measured}
    sent = {r.number: r.sent_ms for r in sim.measured}
    pulled = {n for n in ttft if n in sim.landed}
    slowest = sorted(ttft, key=ttft.__getitem__)[int(0.95 * len(ttft)) :]
    parts = []
    for n in sorted(pulled):
        pull, landed = sim.landed[n]
        parts.append(
            PulledRequest(
                lease_wait=pull.held_ms - pull.started_ms,
                bytes=pull.done_ms - pull.held_ms,
                puller_step=landed - pull.done_ms,
                landing_to_first_token=ttft[n] - (landed - sent[n]),
                ttft=ttft[n],
            )
        )
    rest = [ttft[n] for n in ttft if n not in pulled]
    return parts, rest, sum(n in pulled for n in slowest)


def run_cell(
    tiers: kt.TierShape, shape: Shape, load: float, seed: int, renderer: PromptRenderer
) -> tuple[dict[str, Any], dict[str, Any], _Traced]:
    """``host`` and ``host+pulls`` on the cell (``load`` 0: the closed loop; else Poisson arrivals at
    that share of ``none``'s closed-loop throughput): both results and the traced pulls' run."""
    setups = {setup.name: setup for setup in kt.SETUPS}
    arrivals = None
    if load:
        none = kt.TierSimulation(shape, tiers, setups["none"], seed, renderer).run()
        count = shape.warmup + shape.measured + shape.concurrency
        arrivals = kt.poisson_arrivals(load * none["requests_per_s"], count, seed)
    host = _Traced(shape, tiers, setups["host"], seed, renderer, arrivals).run()
    sim = _Traced(shape, tiers, setups["host+pulls"], seed, renderer, arrivals)
    return host, sim.run(), sim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", choices=["tenants", "turns"])
    parser.add_argument("load", type=float, help="open-loop share of none's throughput; 0: closed loop")
    parser.add_argument("seed", type=int)
    parser.add_argument("--profile", default="gpu-ratio", choices=list(kt.PROFILES))
    args = parser.parse_args(argv)
    tiers = kt.TierShape(
        trace=args.trace,
        working_set=3.0,
        num_workers=32,
        pool_blocks=48,
        prefix_blocks=16,
        max_turns=6,
        concurrency=2,
        profile=args.profile,
    )
    renderer = PromptRenderer.from_pretrained(kt.DEMO_MODEL)
    host, pulls, sim = run_cell(tiers, kt.sim_shape(tiers, 1500, 1500), args.load, args.seed, renderer)
    for name, result in (("host", host), ("host+pulls", pulls)):
        print(name, {key: round(result[key], 3) for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")})
    parts, rest, num_slowest = pulled_requests(sim)
    num_measured = len(parts) + len(rest)
    print(
        f"  pulled {len(parts)} of {num_measured} measured, {num_slowest} of the slowest {num_measured - int(0.95 * num_measured)}"
    )
    print(
        "  p50/p90/p99 ms: lease wait",
        _quantiles([part.lease_wait for part in parts]),
        "bytes",
        _quantiles([part.bytes for part in parts]),
        "puller's step",
        _quantiles([part.puller_step for part in parts]),
        "landing to first token",
        _quantiles([part.landing_to_first_token for part in parts]),
    )
    print(
        "  TTFT p50/p90/p99 ms: pulled",
        _quantiles([part.ttft for part in parts]),
        "the rest",
        _quantiles(rest),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
