"""vLLM's KV event batches in order, from its ZMQ sockets.

vLLM's PUB socket connects to the SUB socket bound here (loopback), so whichever starts first, the
two meet. Batches are numbered from 0; a batch after a gap (the sidecar started late, or ZMQ dropped
some) first asks vLLM's ROUTER replay socket for the missing ones: a DEALER sends the first wanted
number (8 bytes, big-endian) and receives ``[b"", topic, seq, payload]`` frames up to an end marker
of seq -1. Batches vLLM no longer keeps (its buffer holds 10,000) are lost: logged, and the cache
view is missing those blocks until they are stored again. A number lower than expected means vLLM
restarted and counts from 0 again.

PUB drops what it publishes before the SUB's subscription reaches it (the first batches after the
two connect, a second or more), and a batch dropped then would only be noticed at the next one; and a
restarted vLLM's first batches may all be dropped so. So a second without batches also asks the
replay socket for the batches from the last one applied on: anything newer is applied, and a last
batch vLLM no longer has under its number means it restarted (at the start: everything vLLM
published before this process listened).
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
        idle_replay_s: float = 1.0,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_events, self.on_restart = on_events, on_restart
        self.replay_timeout_s, self.idle_replay_s = replay_timeout_s, idle_replay_s
        self.next_seq = 0
        self.num_lost = 0
        self._last_payload = b""
        self._context = zmq.asyncio.Context()

    async def run(self) -> None:
        """Receive until cancelled."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.bind(self.endpoint)
        try:
            while True:
                if await sub.poll(self.idle_replay_s * 1000):
                    _, seq_frame, payload = await sub.recv_multipart()
                    await self._receive(decode_seq(seq_frame), payload)
                else:
                    await self._catch_up()
        finally:
            sub.close(linger=0)
            self._context.term()

    async def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            self._restarted()
        if seq > self.next_seq:
            for replayed, replayed_payload in await self._fetch(self.next_seq) or []:
                if replayed < seq:
                    self._apply(replayed, replayed_payload)
        self._apply(seq, payload)

    async def _catch_up(self) -> None:
        """Apply what vLLM published that the PUB socket did not bring; notice a restarted vLLM,
        whose replay buffer lacks the last batch applied here or holds another one under its number."""
        last = self.next_seq - 1
        replies = await self._fetch(max(last, 0))
        if replies is None:
            return
        if last >= 0 and replies[:1] != [(last, self._last_payload)]:
            self._restarted()
            replies = await self._fetch(0) or []
        for seq, payload in replies:
            self._apply(seq, payload)

    def _restarted(self) -> None:
        logger.warning("vLLM restarted: its KV events count from 0 again", extra={"next_seq": self.next_seq})
        self.next_seq = 0
        self.on_restart()

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # applied already
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
        self.next_seq, self._last_payload = seq + 1, payload

    async def _fetch(self, from_seq: int) -> list[tuple[int, bytes]] | None:
        """The batches from ``from_seq`` on that vLLM still keeps, in order; ``None`` if it did not
        answer in time (still loading, or gone)."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        replies: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", from_seq.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while (seq := decode_seq((reply := await dealer.recv_multipart())[2])) != _END_SEQ:
                    replies.append((seq, reply[3]))
        except TimeoutError:
            logger.debug("vLLM's KV event replay did not answer in time", extra={"from_seq": from_seq})
            return None
        finally:
            dealer.close(linger=0)
        return replies
