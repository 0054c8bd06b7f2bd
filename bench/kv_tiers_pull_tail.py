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
from typing import Any

import kv_tiers as kt
from routing_sim import Request, SimWorker

from herd.api.prompt import PromptRenderer


def _quantiles(values: list[float]) -> list[int]:
    """p50, p90 and p99, rounded."""
    ordered = sorted(values)
    return [round(ordered[int(share * (len(ordered) - 1))]) for share in (0.5, 0.9, 0.99)]


class _Traced(kt.TierSimulation):
    """``TierSimulation`` recording each pull's times by request number."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times: dict[int, dict[str, float]] = {}
        self.measured: list[Request] = []

    def _lend(
        self,
        puller: SimWorker,
        peer: SimWorker,
        request: Request,
        hashes: list[int],
        missing: list[int],
        started_ms: float,
    ) -> None:
        super()._lend(puller, peer, request, hashes, missing, started_ms)
        self.times[request.number] = {"started": started_ms, "held": peer.clock.now * 1000}

    def _land(self, pull: kt.Pull) -> None:
        self.times[pull.request.number] |= {"done": pull.done_ms, "landed": self.now}
        super()._land(pull)

    def _summary(self, measured: list[Request]) -> dict[str, Any]:
        self.measured = measured
        return super()._summary(measured)


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
    shape = kt.sim_shape(tiers, 1500, 1500)
    renderer = PromptRenderer.from_pretrained(kt.DEMO_MODEL)
    setups = {setup.name: setup for setup in kt.SETUPS}
    arrivals = None
    if args.load:
        none = kt.TierSimulation(shape, tiers, setups["none"], args.seed, renderer).run()
        count = shape.warmup + shape.measured + shape.concurrency
        arrivals = kt.poisson_arrivals(args.load * none["requests_per_s"], count, args.seed)
    for name in ("host", "host+pulls"):
        sim = _Traced(shape, tiers, setups[name], args.seed, renderer, arrivals)
        result = sim.run()
        print(name, {key: round(result[key], 3) for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")})
        if name == "host":
            continue
        ttft = {r.number: (r.first_token_ms or 0.0) - r.sent_ms for r in sim.measured}
        sent = {r.number: r.sent_ms for r in sim.measured}
        slowest = sorted(ttft, key=ttft.__getitem__)[int(0.95 * len(ttft)) :]
        pulled = {n for n in ttft if "landed" in sim.times.get(n, {})}
        times = sim.times
        print(
            f"  pulled {len(pulled)} of {len(ttft)} measured, {sum(n in pulled for n in slowest)} of the slowest {len(slowest)}"
        )
        print(
            "  p50/p90/p99 ms: lease wait",
            _quantiles([times[n]["held"] - times[n]["started"] for n in pulled]),
            "bytes",
            _quantiles([times[n]["done"] - times[n]["held"] for n in pulled]),
            "puller's step",
            _quantiles([times[n]["landed"] - times[n]["done"] for n in pulled]),
            "landing to first token",
            _quantiles([ttft[n] - (times[n]["landed"] - sent[n]) for n in pulled]),
        )
        print(
            "  TTFT p50/p90/p99 ms: pulled",
            _quantiles([ttft[n] for n in pulled]),
            "the rest",
            _quantiles([ttft[n] for n in ttft if n not in pulled]),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
