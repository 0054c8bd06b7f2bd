"""The prefill/decode pair of a disaggregated request: where its uncached part is computed, and by whom.

Pure rules over worker views (no I/O), used by ``decide``:

- ``num_uncached_tokens``: the prompt's tokens past the leading blocks a worker already holds;
- ``choose_prefill``: the prefill worker with the least work for this prompt;
- ``choose_path`` (conditional disaggregation): remote on the prefill pool, or local on the decode worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from herd.orchestrator.routing._types import WorkerView

__all__ = [
    "MIN_REMOTE_BLOCKS",
    "PrefillPath",
    "choose_path",
    "choose_prefill",
    "num_uncached_tokens",
]

PrefillPath = Literal["remote_prefill", "local_prefill"]

MIN_REMOTE_BLOCKS = 4
"""Below this many uncached blocks a prompt prefills on its decode worker even beside an idle
prefill pool: a short local chunk costs the decode batch less than a round trip adds to TTFT."""


def num_uncached_tokens(num_tokens: int, num_cached_blocks: int, block_size: int) -> int:
    return max(0, num_tokens - num_cached_blocks * block_size)


def choose_path(
    num_uncached: int,
    prefill: WorkerView | None,
    *,
    queued_tokens: int,
    threshold_tokens: int,
    block_size: int,
) -> PrefillPath:
    """Where a prompt's uncached part is computed (conditional disaggregation).

    - no prefill worker: locally on the decode worker;
    - at least ``threshold_tokens``: on ``prefill``, whatever its queue (a long local prefill
      would stall every decode on the decode worker, which is what disaggregation avoids);
    - shorter, but ``MIN_REMOTE_BLOCKS`` blocks or more: on ``prefill`` while ``queued_tokens``
      there plus this prompt stay within ``threshold_tokens``, so it waits there no longer than
      for a prompt the decode worker would prefill itself, and a burst of short prompts is shared
      between the two workers instead of piling onto the decode worker's steps;
    - otherwise locally.
    """
    if prefill is None:
        return "local_prefill"
    if num_uncached >= threshold_tokens:
        return "remote_prefill"
    if num_uncached >= MIN_REMOTE_BLOCKS * block_size and queued_tokens + num_uncached <= threshold_tokens:
        return "remote_prefill"
    return "local_prefill"


def choose_prefill(
    workers: Sequence[WorkerView], cached_blocks: Mapping[str, int], block_size: int
) -> WorkerView | None:
    """The worker with the least prefill work for this prompt: queued tokens (``WorkerView.queued_prefill_tokens``)
    minus its cached prefix.

    Ties go to fewer requests in flight from this orchestrator, then to the id (stable).
    """
    if not workers:
        return None
    return min(
        workers,
        key=lambda worker: (
            worker.queued_prefill_tokens - cached_blocks.get(worker.id, 0) * block_size,
            worker.num_in_flight,
            worker.id,
        ),
    )
