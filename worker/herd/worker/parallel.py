"""Tensor parallelism: one model split over ``size`` ranks, one process each, summed by all-reduce.

Megatron's split, as vLLM runs it: a column-parallel layer (q/k/v, gate/up) holds a slice of the
output rows, so each rank computes its own attention heads and MLP columns with no communication; a
row-parallel layer (o_proj, down_proj) holds the matching slice of the input columns, and the ranks'
partial outputs are summed by one all-reduce. Two all-reduces per layer; embeddings, norms and the
LM head stay whole on every rank, so every rank ends a forward with the same hidden states and rank 0
alone samples. Each rank's KV pool holds only its own KV heads.

Heads go to ranks in whole KV groups (a KV head with the query heads that read it), as evenly as they
divide: SmolLM2's 3 KV heads over 2 ranks are 2 and 1. Rank 0 runs the scheduler and the server; each
step it broadcasts the step's inputs (``broadcast_object``) and every rank runs the same forward.

The process group is built directly on a ``TCPStore`` (gloo on CPU, NCCL on CUDA), not as
torch.distributed's global default group, so that one process may hold several engines (tests).
"""

from __future__ import annotations

import ctypes
import pickle
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TensorParallel",
    "connect_store",
    "die_with_parent",
    "join",
    "listen",
    "partition",
    "rank_device",
]

GROUP_TIMEOUT = timedelta(days=30)
"""How long a rank waits in a collective: a follower waits for rank 0's next step however idle the
server is (a follower whose rank 0 died is ended by its parent-death signal, not by this)."""


def partition(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``total`` units cut into ``parts`` near-equal runs: ``(first, count)``; the
    first ``total % parts`` parts hold one unit more."""
    base, extra = divmod(total, parts)
    first = index * base + min(index, extra)
    return first, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among ``size`` and the process group they share (``None`` for size 1)."""

    rank: int
    size: int
    group: Any = None

    def part(self, total: int) -> tuple[int, int]:
        """This rank's ``(first, count)`` of ``total`` units."""
        return partition(total, self.size, self.rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        if self.group is not None:
            self.group.allreduce([tensor]).wait()
        return tensor

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a KV pool every rank can hold)."""
        if self.group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self._device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs name another type
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (pickled; tensors in it should be on the CPU)."""
        if self.group is None:
            return value
        payload = pickle.dumps(value) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.long, device=self._device)
        self._broadcast(size)
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        )
        self._broadcast(buffer)
        return value if self.rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    @property
    def _device(self) -> torch.device:
        """Where NCCL wants collective buffers: this rank's GPU; gloo takes the CPU."""
        is_nccl = self.group is not None and type(self.group).__name__ == "ProcessGroupNCCL"
        return torch.device("cuda", torch.cuda.current_device()) if is_nccl else torch.device("cpu")


_TCP_STORE: Any = dist.TCPStore  # type: ignore[attr-defined]  # torch's stubs do not export it
STORE_TIMEOUT = timedelta(minutes=5)
"""How long the ranks wait for one another to start (each loads its slice of the model first)."""


def listen(size: int, host: str = "127.0.0.1") -> Any:
    """Rank 0's rendezvous store (a ``TCPStore``) on a free port of ``host`` (``store.port``)."""
    return _TCP_STORE(host, 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def connect_store(host: str, port: int, size: int) -> Any:
    """A follower's connection to rank 0's store."""
    return _TCP_STORE(host, port, size, False, timeout=STORE_TIMEOUT)


def join(store: Any, rank: int, size: int, device: torch.device) -> TensorParallel:
    """The process group of ``size`` ranks meeting at ``store`` (returns once every rank joined):
    NCCL on CUDA, gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)
    return TensorParallel(rank, size, group)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device in its pod: GPU ``rank`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def die_with_parent() -> None:
    """End this process when its parent (rank 0's worker) ends, however it ends (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1
