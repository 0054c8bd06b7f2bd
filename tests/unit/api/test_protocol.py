"""herd.api.protocol: what the internal protocol's models refuse where a peer's message enters."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from herd.api.protocol import KVSnapshot, KVTransferParams, LoadReport

SNAPSHOT = {"epoch": "e", "seq": 1, "block_size": 16, "block_hashes": [1]}


@pytest.mark.parametrize(
    ("model", "fields", "words"),
    [
        (LoadReport, {"num_running": -1}, "greater than or equal to 0"),
        (LoadReport, {"num_running": 10**400}, "less than or equal to"),  # would overflow a float cost
        (LoadReport, {"bytes_per_block": 10**400}, "less than or equal to"),
        (LoadReport, {"prefill_tokens_per_s": float("inf")}, "finite number"),
        (LoadReport, {"decode_step_s": float("nan")}, "finite number"),
        (LoadReport, {"pull_bytes_per_s": 1e300}, "less than or equal to"),
        (LoadReport, {"restore_bytes_per_s": {"host": 0}}, "greater than 0"),
        (KVSnapshot, {**SNAPSHOT, "tier_block_hashes": {"device": [7]}}, "the tiers below the device"),
        (KVTransferParams, {"lease_seconds": float("nan")}, "finite number"),  # a lease that never expires
        (KVTransferParams, {"remote_port": 70000}, "less than or equal to 65535"),
    ],
    ids=["negative-count", "huge-count", "huge-block", "infinite-rate", "nan-step", "huge-rate",
         "zero-bandwidth", "device-as-a-lower-tier", "nan-lease", "port-out-of-range"],
)  # fmt: skip
def test_a_peers_message_out_of_range_is_refused(
    model: type[BaseModel], fields: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        model.model_validate(fields)
