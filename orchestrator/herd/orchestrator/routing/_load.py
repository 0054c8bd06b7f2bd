"""Load rules shared by several strategies: least in-flight, and the bounded-load cap.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads"): with
``T`` requests in flight over ``n`` candidate workers, a worker may take the new request only if
``num_in_flight + 1 <= cap`` where ``cap = ceil(load_factor * (T + 1) / n)``. After the assignment
no worker holds more than ``load_factor x mean + 1`` (the ceiling adds at most one), and because
the least loaded worker holds at most ``floor(T / n)``, some worker is always under the cap.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from herd.orchestrator.routing._types import WorkerView

__all__ = ["bounded_load_cap", "least_in_flight"]


def bounded_load_cap(workers: Sequence[WorkerView], load_factor: float) -> int:
    """The most requests in flight a worker may hold after taking one more."""
    total = sum([worker.num_in_flight for worker in workers])
    return math.ceil(load_factor * (total + 1) / len(workers))


def least_in_flight(workers: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    """The worker with the fewest requests in flight; ties broken at random."""
    fewest = min([worker.num_in_flight for worker in workers])
    tied = [worker for worker in workers if worker.num_in_flight == fewest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
