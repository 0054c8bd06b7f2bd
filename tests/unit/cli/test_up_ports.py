"""``herd up``'s port blocks for a simulated fleet: a fleet too large for one machine is a clear error."""

from __future__ import annotations

import pytest

from herd.cli.up import UpError, free_port_block


def test_a_block_is_consecutive_free_loopback_ports() -> None:
    ports = free_port_block(4)
    assert ports == list(range(ports[0], ports[0] + 4)) and ports[-1] < 32768


@pytest.mark.parametrize(
    "count", [6385, 20_000, 40_000], ids=["just-over", "replicas-20000", "past-the-range"]
)
def test_more_ports_than_a_machine_has_below_the_ephemeral_range_is_an_up_error(count: int) -> None:
    with pytest.raises(UpError, match="run fewer replicas"):
        free_port_block(count)
