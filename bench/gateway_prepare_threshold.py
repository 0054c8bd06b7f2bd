"""Where the gateway should move prompt preparation (JSON parsing, chat template, tokenization) off
its event loop: per body size, the time to prepare a chat request inline and through a thread, and
the event loop's longest stall while a 3.6 MiB prompt is prepared on a thread.

    .venv/bin/python bench/gateway_prepare_threshold.py --model .cache/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer

SIZES = (256, 1024, 4096, 16384, 65536)
TEXT = "The quick brown fox jumps over the lazy dog. " * 90_000


def prepare(renderer: PromptRenderer, body: bytes) -> int:
    """What the gateway does with a body before routing: parse, validate, render, tokenize."""
    request = ChatCompletionRequest.model_validate(json.loads(body))
    return len(renderer.chat_request_ids(request))


def body_of(size: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": TEXT[:size]}]}).encode()


async def per_call_us(work: Callable[[], object], executor: ThreadPoolExecutor | None, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for _ in range(repeats):
        if executor is None:
            work()
        else:
            await loop.run_in_executor(executor, work)
    return (time.perf_counter() - started) / repeats * 1e6


async def longest_stall_ms(renderer: PromptRenderer, executor: ThreadPoolExecutor) -> float:
    """The loop's longest gap between 1 ms ticks while a 3.6 MiB prompt is prepared on a thread."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.get_running_loop().run_in_executor(executor, prepare, renderer, body_of(3_600_000))
    ticker.cancel()
    return max(gaps) * 1000


async def measure(renderer: PromptRenderer) -> dict[str, object]:
    rows = []
    with ThreadPoolExecutor(2) as executor:
        for size in SIZES:
            body = body_of(size)
            repeats = max(20, 200_000 // size)
            inline = await per_call_us(lambda body=body: prepare(renderer, body), None, repeats)  # type: ignore[misc]
            threaded = await per_call_us(lambda body=body: prepare(renderer, body), executor, repeats)  # type: ignore[misc]
            rows.append({"body_bytes": len(body), "inline_us": round(inline), "thread_us": round(threaded)})
        stall = await longest_stall_ms(renderer, executor)
    return {"per_body_size": rows, "loop_longest_stall_ms_while_3_6_mib_on_a_thread": round(stall, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a model folder with tokenizer.json")
    args = parser.parse_args()
    report = asyncio.run(measure(PromptRenderer.from_pretrained(args.model)))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
