"""Run by the vLLM environment's Python (not herd's): vLLM's own ZmqEventPublisher, publishing the
KV event batches it reads from stdin, one JSON list of events a line, until stdin closes.

    python vllm_kv_publisher.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC BLOCK_SIZE

An event is {"stored": [hashes, parent, token_ids, extra_keys]}, {"removed": hashes} or {"cleared": null}.
"""

import json
import sys
import time

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def event(spec, block_size):
    ((kind, value),) = spec.items()
    if kind == "stored":
        hashes, parent, tokens, extra_keys = value
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=extra_keys,
        )
    if kind == "removed":
        return BlockRemoved(block_hashes=value, medium="GPU")
    return AllBlocksCleared()


def main():
    endpoint, replay, topic, block_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    publisher = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic=topic)
    for line in sys.stdin:
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[event(spec, block_size) for spec in json.loads(line)])
        )
        print("published", flush=True)
    publisher.shutdown()


main()
