"""bench/kv_tiers_pull_tail.py's breakdown of a pulled request's TTFT, on a small simulated fleet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import kv_tiers
import kv_tiers_pull_tail

from herd.api.prompt import PromptRenderer


@pytest.mark.slow
def test_a_pulled_requests_parts_add_up_to_its_ttft(demo_model: Path) -> None:
    """8 workers, multi-tenant at 3x, open loop at 0.8: some requests pull, and each one's lease
    wait, bytes, wait for the puller's step and landing to first token are never negative and add
    up to its TTFT; pulled and others are every measured request."""
    tiers = kv_tiers.TierShape("tenants", 3.0, 8, 48, 16, 6, 2, "gpu-ratio")
    shape = kv_tiers.sim_shape(tiers, warmup=100, measured=200)
    renderer = PromptRenderer.from_pretrained(demo_model)
    host, pulls, sim = kv_tiers_pull_tail.run_cell(tiers, shape, 0.8, 0, renderer)
    parts, rest, num_slowest = kv_tiers_pull_tail.pulled_requests(sim)
    assert len(parts) + len(rest) == len(sim.measured) == 200
    assert len(parts) >= 5 and num_slowest <= min(len(parts), 10)
    # The host setup pulls nothing; the pulls setup's count covers its warm-up too.
    assert host["pulls_pulled"] == 0 and pulls["pulls_pulled"] >= len(parts)
    for part in parts:
        assert min(part.lease_wait, part.puller_step, part.landing_to_first_token) >= 0
        assert part.bytes > 0
        total = part.lease_wait + part.bytes + part.puller_step + part.landing_to_first_token
        assert total == pytest.approx(part.ttft)
