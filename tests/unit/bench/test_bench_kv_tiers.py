"""bench/kv_tiers.py's fleet construction: tier profiles, which workers get the slow disk, and the
per-worker cost models and load reports that follow from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import kv_tiers
from routing_sim import BLOCK_SIZE, ISSUE14_COST

from herd.api.prompt import PromptRenderer
from herd.orchestrator.routing import restore_block_tokens

BLOCK_BYTES = 737_280  # the demo model's fp32 block of 16 tokens (720 KiB)
BLOCK_MS = BLOCK_SIZE * ISSUE14_COST["token_ms"]


@pytest.mark.parametrize(
    ("num_workers", "share", "slow"),
    [
        (4, 0.0, [False, False, False, False]),
        (4, 0.5, [False, True, False, True]),
        (4, 0.25, [False, False, False, True]),
        (3, 1.0, [True, True, True]),
        (8, 0.5, [False, True] * 4),
    ],
)
def test_slow_workers_spreads_the_share(num_workers: int, share: float, slow: list[bool]) -> None:
    assert kv_tiers.slow_workers(num_workers, share) == slow


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_slow_workers_refuses_a_share_outside_0_1(share: float) -> None:
    with pytest.raises(ValueError, match="slow-disk-share"):
        kv_tiers.slow_workers(4, share)


@pytest.mark.parametrize(
    ("profile", "host", "disk", "slow_disk"),
    [
        # Measured bandwidths pass through.
        ("cpu", 6.5, 0.6, 0.6),
        # Ratios become bandwidths: restore time = ratio x a block's recompute time.
        (
            "gpu-ratio",
            BLOCK_BYTES / (0.08 * BLOCK_MS / 1000) / 1e9,
            BLOCK_BYTES / (0.4 * BLOCK_MS / 1000) / 1e9,
            BLOCK_BYTES / (2.0 * BLOCK_MS / 1000) / 1e9,
        ),
    ],
)
def test_profile_bandwidths(profile: str, host: float, disk: float, slow_disk: float) -> None:
    got = kv_tiers.PROFILES[profile].bandwidths(BLOCK_BYTES, BLOCK_MS)
    assert got == pytest.approx((host, disk, slow_disk))


@pytest.mark.parametrize(
    ("is_slow", "host_ratio", "disk_ratio"),
    [(False, 0.08, 0.4), (True, 0.08, 2.0)],
)
def test_mixed_fleet_charges_each_worker_its_ratio(
    is_slow: bool, host_ratio: float, disk_ratio: float
) -> None:
    """A block's modelled restore over its recompute time is the profile's ratio for its worker's disk."""
    slow = kv_tiers.slow_workers(4, 0.5)
    costs = kv_tiers.fleet_costs(ISSUE14_COST, kv_tiers.PROFILES["gpu-ratio"], slow, BLOCK_BYTES, BLOCK_SIZE)
    assert len(costs) == 4
    for cost, worker_slow in zip(costs, slow, strict=True):
        if worker_slow != is_slow:
            continue
        assert cost.step_ms == ISSUE14_COST["step_ms"] and cost.token_ms == ISSUE14_COST["token_ms"]
        recompute = BLOCK_MS / 1000
        assert cost.move_seconds(BLOCK_BYTES, disk=False) / recompute == pytest.approx(host_ratio)
        assert cost.move_seconds(BLOCK_BYTES, disk=True) / recompute == pytest.approx(disk_ratio)


@pytest.mark.slow
def test_mixed_fleet_reports_its_own_restore_costs(demo_model: Path) -> None:
    """Each simulated worker reports the rates its own cost model charges, so the router prices a
    disk block above a recompute on a slow worker and below it on a fast one."""
    tiers = kv_tiers.TierShape("tenants", 3.0, 4, 64, 8, 6, 2, "gpu-ratio", 0.5)
    shape = kv_tiers.sim_shape(tiers, warmup=40, measured=40)
    setup = next(setup for setup in kv_tiers.SETUPS if setup.name == "host+disk")
    simulation = kv_tiers.TierSimulation(shape, tiers, setup, 0, PromptRenderer.from_pretrained(demo_model))
    simulation.run()
    disk = [restore_block_tokens(worker.report, "disk") for worker in simulation.workers]
    host = [restore_block_tokens(worker.report, "host") for worker in simulation.workers]
    assert all(tokens is not None for tokens in disk + host)
    for tokens, worker_slow in zip(disk, simulation.slow, strict=True):
        assert tokens is not None
        assert (tokens > BLOCK_SIZE) if worker_slow else (tokens < BLOCK_SIZE)
    assert all(tokens is not None and tokens < 0.1 * BLOCK_SIZE for tokens in host)
