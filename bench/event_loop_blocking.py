"""Event-loop blocking: what 3.6 MiB prompts do to everyone else's latency (issue 12, item 5).

One ``herd worker`` and one ``herd orchestrator`` (kv_cache_aware, so the gateway tokenizes every
prompt) on loopback. Two kinds of phase alternate for ``--rounds`` rounds, each ``--seconds`` long:

* quiet: ``GET /v1/models`` on the gateway and on the worker every 50 ms, and two streams through
  the gateway (restarted as they finish) whose inter-chunk gaps are recorded as the client sees them;
* loaded: the same, while one sender posts 3.6 MiB chat prompts to the gateway and another to the
  worker, one after the other (each is refused as longer than maxModelLen, after it is tokenized).

The figures are p50 and p99 per phase and the added p99 (loaded minus quiet); the target is under
50 ms added. Raw samples' summaries go to ``--out`` as JSON. Not a test: the machine is shared.

    .venv/bin/python bench/event_loop_blocking.py --model .cache/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    herd_workers,
    machine_info,
    orchestrator_argv,
    serving,
    thread_env,
    write_json,
)

NAME = "smollm2"
TOKEN = "event-loop-bench-token"
PROBE_INTERVAL_S = 0.05
WORDS = ["paris", "capital", "france", "kubernetes", "operator", "token", "cache", "block", "river", "seven"]


@dataclass
class Samples:
    """Latencies in ms per series (``models_gateway``, ``models_worker``, ``itl``, ``big_prompt``)."""

    series: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.series.setdefault(name, []).append(1000 * seconds)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 2) if ordered else float("nan")


def big_prompt(num_bytes: int) -> str:
    rng = random.Random(0)
    words: list[str] = []
    size = 0
    while size < num_bytes:
        word = f"{rng.choice(WORDS)}{rng.randrange(1000)}"
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


async def probe(
    client: httpx.AsyncClient, url: str, name: str, samples: Samples, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        response = await client.get(url)
        response.raise_for_status()
        samples.add(name, time.perf_counter() - started)
        await asyncio.sleep(PROBE_INTERVAL_S)


async def stream(client: httpx.AsyncClient, gateway: str, samples: Samples, stop: asyncio.Event) -> None:
    """Streams through the gateway, one after another; every gap between chunks is an ITL sample."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 48, "ignore_eos": True, "stream": True}  # fmt: skip
    while not stop.is_set():
        async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            last = None
            async for _ in response.aiter_bytes():
                now = time.perf_counter()
                if last is not None:
                    samples.add("itl", now - last)
                last = now


async def send_big(
    client: httpx.AsyncClient, url: str, prompt: str, samples: Samples, stop: asyncio.Event
) -> None:
    # Encoded once: encoding 3.6 MiB of JSON takes milliseconds on this client's own event loop, which
    # also times the probes and the streams' chunks, and would add its own delay to every sample.
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
    content, headers = body.encode(), {"content-type": "application/json"}
    while not stop.is_set():
        started = time.perf_counter()
        response = await client.post(f"{url}/v1/chat/completions", content=content, headers=headers)
        samples.add(f"big_prompt_{response.status_code}", time.perf_counter() - started)


async def phase(gateway: str, worker: str, prompt: str | None, seconds: float) -> Samples:
    samples, stop = Samples(), asyncio.Event()
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [
            probe(client, f"{gateway}/v1/models", "models_gateway", samples, stop),
            probe(client, f"{worker}/v1/models", "models_worker", samples, stop),
            stream(client, gateway, samples, stop),
            stream(client, gateway, samples, stop),
        ]
        if prompt is not None:
            tasks += [
                send_big(client, gateway, prompt, samples, stop),
                send_big(client, worker, prompt, samples, stop),
            ]

        async def stop_later() -> None:
            await asyncio.sleep(seconds)
            stop.set()

        await asyncio.gather(stop_later(), *tasks)
    return samples


def summarize(phases: list[tuple[str, Samples]]) -> dict[str, Any]:
    """Per series: p50/p99 over every quiet and every loaded phase, and the added p99."""
    merged: dict[str, dict[str, list[float]]] = {"quiet": {}, "loaded": {}}
    for kind, samples in phases:
        for name, values in samples.series.items():
            merged[kind].setdefault(name, []).extend(values)
    table: dict[str, Any] = {}
    for name in sorted(set(merged["quiet"]) | set(merged["loaded"])):
        quiet, loaded = merged["quiet"].get(name, []), merged["loaded"].get(name, [])
        row = {f"{kind}_{stat}": percentile(values, q) for kind, values in (("quiet", quiet), ("loaded", loaded))
               for stat, q in (("p50_ms", 0.5), ("p99_ms", 0.99))}  # fmt: skip
        row |= {"quiet_n": len(quiet), "loaded_n": len(loaded)}
        if quiet and loaded:
            row["added_p99_ms"] = round(row["loaded_p99_ms"] - row["quiet_p99_ms"], 2)
        table[name] = row
    return table


@contextlib.contextmanager
def servers(model: Path, logs: Path, max_body_bytes: int) -> Iterator[tuple[str, str]]:
    """A worker and an orchestrator over it; yields their base URLs."""
    engine = {"maxModelLen": 2048, "kvCache": {"memoryGiB": 0.5}, "device": "cpu", "dtype": "float32"}
    body_limit = ["--max-body-bytes", str(max_body_bytes)]
    manifest = logs / "manifest.yaml"
    manifest.write_text(
        f'{{"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {{"name": "{NAME}"}},'
        f' "spec": {{"model": {{"source": "file://{model}", "servedName": "{NAME}"}},'
        f' "engine": {{"maxModelLen": 2048}}, "routing": {{"strategy": "kv_cache_aware"}}}}}}'
    )
    worker_log, gateway_log = logs / "worker.log", logs / "orchestrator.log"
    with herd_workers(
        model, name=NAME, token=TOKEN, engine=engine, log=worker_log, extra=body_limit
    ) as worker:
        gateway_port = free_port()
        gateway_argv = orchestrator_argv(
            manifest, worker.endpoints, token=TOKEN, port=gateway_port, extra=body_limit
        )
        gateway_url = f"http://{HOST}:{gateway_port}"
        with serving(gateway_argv, ready_url=f"{gateway_url}/ready", log=gateway_log, env=thread_env(1)):
            yield gateway_url, worker.urls[0][0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--prompt-mib", type=float, default=3.6)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "event_loop_blocking.json")
    parser.add_argument("--logs", type=Path, default=REPO / ".cache" / "bench-logs" / "event_loop_blocking")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    prompt = big_prompt(int(args.prompt_mib * 1024 * 1024))
    max_body = len(prompt) + 64 * 1024  # the prompt fits the body limit whatever the defaults are
    phases: list[tuple[str, Samples]] = []
    with servers(args.model.resolve(), args.logs, max_body) as (gateway, worker):
        asyncio.run(phase(gateway, worker, None, 3.0))  # warm-up, not recorded
        for number in range(args.rounds):
            for kind, big in (("quiet", None), ("loaded", prompt)):
                phases.append((kind, asyncio.run(phase(gateway, worker, big, args.seconds))))
                print(f"round {number + 1} {kind}: done", flush=True)
    result = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
              "prompt_bytes": len(prompt), "summary": summarize(phases)}  # fmt: skip
    write_json(args.out, result)
    for name, row in result["summary"].items():
        print(name, row)


if __name__ == "__main__":
    main()
