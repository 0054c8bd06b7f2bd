"""vLLM's KV event batches in order, from its ZMQ sockets.

vLLM's PUB socket connects to the SUB socket bound here (loopback), so whichever starts first, the
two meet. Batches are numbered from 0; a batch after a gap (the sidecar started late, or ZMQ dropped
some) first asks vLLM's ROUTER replay socket for the missing ones: a DEALER sends the first wanted
number (8 bytes, big-endian) and receives ``[b"", topic, seq, payload]`` frames up to an end marker
of seq -1. Batches vLLM no longer keeps (its buffer holds 10,000) are lost: logged, and the cache
view is missing those blocks until they are stored again. A number lower than expected means vLLM
restarted and counts from 0 again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from herd.sidecar._wire import VLLMEvent, WireError, decode_batch, decode_seq

__all__ = ["KVEventSubscriber"]

logger = logging.getLogger(__name__)

_END_SEQ = -1


class KVEventSubscriber:
    """Receives vLLM's batches and hands each one's events, in order, to ``on_events``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        topic: str,
        on_events: Callable[[list[VLLMEvent]], None],
        on_restart: Callable[[], None],
        *,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_events, self.on_restart = on_events, on_restart
        self.replay_timeout_s = replay_timeout_s
        self.next_seq = 0
        self.num_lost = 0
        self._context = zmq.asyncio.Context()

    async def run(self) -> None:
        """Receive until cancelled."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.bind(self.endpoint)
        try:
            await self._replay(until=None)  # what vLLM published before this process started
            while True:
                _, seq_frame, payload = await sub.recv_multipart()
                await self._receive(decode_seq(seq_frame), payload)
        finally:
            sub.close(linger=0)
            self._context.term()

    async def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            logger.warning("vLLM restarted: its KV events count from 0 again", extra={"seq": seq})
            self.next_seq = 0
            self.on_restart()
        if seq > self.next_seq:
            await self._replay(until=seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied from a replay
        if seq > self.next_seq:
            self.num_lost += seq - self.next_seq
            logger.warning(
                "lost KV event batches vLLM no longer keeps; their blocks count once stored again",
                extra={"from_seq": self.next_seq, "to_seq": seq - 1},
            )
        try:
            self.on_events(decode_batch(payload))
        except WireError as error:
            logger.warning("skipped a KV event batch vLLM sent", extra={"seq": seq, "error": str(error)})
        self.next_seq = seq + 1

    async def _replay(self, until: int | None) -> None:
        """Apply the batches from ``next_seq`` up to ``until`` (excluded; ``None``: all) that vLLM
        still keeps; the batch ``until`` itself then counts whatever is still missing as lost."""
        wanted = self.next_seq
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", wanted.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while (seq := decode_seq((reply := await dealer.recv_multipart())[2])) != _END_SEQ:
                    if until is None or seq < until:
                        self._apply(seq, reply[3])
        except TimeoutError:  # vLLM still loading (at start), or gone
            logger.info("vLLM's KV event replay did not answer in time", extra={"from_seq": wanted})
        finally:
            dealer.close(linger=0)
