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

import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "STORE_TIMEOUT",
    "TensorParallel",
    "announce",
    "await_ranks",
    "connect_store",
    "exit_with_parent",
    "join",
    "listen",
    "partition",
    "rank_device",
]

GROUP_TIMEOUT = timedelta(days=30)
"""How long a rank waits in a collective: a follower waits for rank 0's next step however idle the
server is (a follower whose rank 0 died sees its connection close, or is ended by ``exit_with_parent``)."""


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


def listen(size: int, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Rank 0's rendezvous store (a ``TCPStore``) on ``host:port`` (port 0: a free one, ``store.port``).
    The socket is bound here and handed to torch, whose own store server would listen on every
    interface; ``0.0.0.0`` is for a group whose other pods dial in."""
    server = socket.create_server((host, port))
    bound = server.getsockname()[1]
    dial = "127.0.0.1" if host == "0.0.0.0" else host  # rank 0 dials its own store
    return _TCP_STORE(
        dial,
        bound,
        size,
        True,
        timeout=STORE_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=server.detach(),
    )


def connect_store(host: str, port: int, size: int, timeout: timedelta = STORE_TIMEOUT) -> Any:
    """A follower's connection to rank 0's store, retried until ``timeout``; a ``TimeoutError``
    names the address when rank 0's store never answered."""
    try:
        return _TCP_STORE(host, port, size, False, timeout=timeout)
    except (RuntimeError, TimeoutError) as error:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
        raise TimeoutError(
            f"rank 0's rendezvous store at {host}:{port} did not answer within {timeout} ({error}): check "
            "that the leader runs and that this address and port reach it"
        ) from error


def join(store: Any, rank: int, size: int, device: torch.device, host: str | None = None) -> TensorParallel:
    """The process group of ``size`` ranks meeting at ``store`` (returns once every rank joined):
    NCCL on CUDA, gloo on the CPU, its connections on ``host``'s interface (None: the interface of
    this machine's hostname, gloo's default)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        gloo: Any = dist.ProcessGroupGloo  # torch's stubs do not declare _Options
        gloo_options = gloo._Options()
        gloo_options._timeout = GROUP_TIMEOUT
        device_of = gloo.create_default_device() if host is None else gloo.create_device(hostname=host)
        gloo_options._devices = [device_of]
        group = gloo(store, rank, size, gloo_options)
    return TensorParallel(rank, size, group)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a pod's ``local_rank``-th rank: GPU ``local_rank`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def announce(store: Any, rank: int) -> None:
    """Tell rank 0 that ``rank`` reached its store (``await_ranks``)."""
    store.set(_joined_key(rank), "1")


def await_ranks(store: Any, size: int, check_alive: Callable[[], None], timeout: timedelta) -> None:
    """Wait until ranks 1..size-1 announced themselves, calling ``check_alive`` between polls (it
    raises when a local rank's process ended: a rank that died never joins, and without this rank
    0 would learn it only at the store's timeout, minutes later). Raises ``TimeoutError`` naming
    the ranks still missing after ``timeout``."""
    keys = [_joined_key(rank) for rank in range(1, size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys, 1) if not store.check([key])]
            raise TimeoutError(
                f"tensor-parallel ranks {missing} did not join rank 0 within {timeout}: check that "
                "their processes (pods) run and reach rank 0's address"
            )
        time.sleep(_POLL_S)


def _joined_key(rank: int) -> str:
    return f"herd/joined/{rank}"


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as its parent ``parent_pid`` (rank 0's worker) is gone, however it
    ended. A thread watches the parent pid: Linux's parent-death signal would fire when the parent's
    *thread* that started this process ends, which kills ranks started from a short-lived thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="herd-parent-watch", daemon=True).start()


_POLL_S = 0.2
