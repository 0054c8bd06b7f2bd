"""Issue 21's resume benchmark: 20 greedy streams in flight and a worker killed with SIGKILL.

Two ``herd worker`` processes (SmolLM2-135M on the CPU, one thread each) behind ``herd orchestrator``
(least_request, so each worker runs half of the streams). Twenty distinct chat prompts are streamed
at once, greedy, ``--output-len`` tokens each (``ignore_eos``), with usage. Two setups alternate over
``--rounds`` rounds, on the same processes:

* ``undisturbed``: the twenty streams run to their end.
* ``killed``: once every stream has ``--kill-after`` content events, worker-0 is SIGKILLed; its
  streams go on from worker-1 (``herd.api.resume``). Worker-0 is started again on its ports after.

Each stream's text is compared with the same prompt's text in the round's undisturbed run. Reported
per run: streams complete (``[DONE]``, no error event), streams with the same text and the same
usage as undisturbed, streams resumed (the gateway's ``herd_router_stream_resumes_total``), the wall
time of the twenty, and for the resumed streams the longest pause between two events their client saw.

    .venv/bin/python bench/resume_kill.py --rounds 3 --out bench/results/resume_kill.json
    .venv/bin/python bench/resume_kill.py --rounds 3 --backend simulated --out bench/results/resume_kill_sim.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    HerdWorkers,
    demo_manifest,
    free_port,
    herd_workers,
    orchestrator_argv,
    serving,
    write_report,
)

from herd.api.protocol import WORKER_HEADER
from herd.cli.up import free_port_block

NAME = "smol"
TOKEN = "resume-kill"
ENGINES: dict[str, dict[str, Any]] = {
    "herd": {
        "device": "cpu",
        "dtype": "float32",
        "maxModelLen": 1024,
        "maxBatchSize": 32,
        "kvCache": {"memoryGiB": 0.5},
    },
    "simulated": {"backend": "simulated", "maxModelLen": 1024, "maxBatchSize": 32},
}
TOPICS = [
    "the sea", "a lighthouse", "winter", "a library", "the moon", "a train", "bread", "a garden",
    "rain", "a violin", "the desert", "a clock", "mountains", "a bridge", "coffee", "a river",
    "snow", "a market", "the stars", "a forest",
]  # fmt: skip
SETUPS = ("undisturbed", "killed")
KILLED = "worker-0"


class Stream:
    """One client's view of its stream."""

    def __init__(self) -> None:
        self.worker = ""
        self.text = ""
        self.num_events = 0
        self.usage: dict[str, Any] | None = None
        self.is_done = False
        self.error: Any = None
        self.max_gap_s = 0.0
        self.ids: set[str] = set()


async def stream(client: httpx.AsyncClient, topic: str, args: argparse.Namespace, out: Stream) -> None:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": f"Write a short poem about {topic}."}],
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        out.worker = response.headers.get(WORKER_HEADER, "")
        last = time.monotonic()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            out.max_gap_s, last = max(out.max_gap_s, now - last), now
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                out.is_done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            out.ids.add(chunk["id"])
            out.usage = chunk.get("usage") or out.usage
            for choice in chunk["choices"]:
                out.text += choice["delta"].get("content") or ""
                out.num_events += 1


async def run_streams(url: str, args: argparse.Namespace, kill: int | None) -> tuple[list[Stream], float]:
    streams = [Stream() for _ in TOPICS]
    async with httpx.AsyncClient(
        base_url=url, timeout=600.0, limits=httpx.Limits(max_connections=64)
    ) as client:
        started = time.monotonic()
        tasks = [
            asyncio.create_task(stream(client, topic, args, out))
            for topic, out in zip(TOPICS, streams, strict=True)
        ]
        if kill is not None:
            async with asyncio.timeout(300):
                while min(out.num_events for out in streams) < args.kill_after:
                    await asyncio.wait(tasks, timeout=0.02)
            os.kill(kill, signal.SIGKILL)
        await asyncio.gather(*tasks)
        return streams, time.monotonic() - started


def resumes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("herd_router_stream_resumes_total") and 'outcome="resumed"' in line
    )


def wait_admitted(url: str, count: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = httpx.get(f"{url}/dashboard/data", timeout=10).json()["workers"]
        if len(rows) == count and all(row["healthy"] for row in rows):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not admit {count} workers in 120 s")


def _tokens(out: Stream) -> tuple[int, int]:
    """The usage's token counts (its cached tokens differ from run to run with the prefix cache)."""
    usage = out.usage or {}
    return usage.get("prompt_tokens", -1), usage.get("completion_tokens", -1)


def summarize(
    setup: str, streams: list[Stream], reference: list[Stream] | None, wall_s: float
) -> dict[str, Any]:
    moved = [out for out in streams if out.worker == KILLED] if setup == "killed" else []
    same = [
        out.text == ref.text and _tokens(out) == _tokens(ref)
        for out, ref in zip(streams, reference or streams, strict=True)
    ]
    return {
        "setup": setup,
        "num_streams": len(streams),
        "num_complete": sum(out.is_done and out.error is None for out in streams),
        "num_same_as_undisturbed": None if reference is None else sum(same),
        "num_on_killed_worker": len(moved),
        "num_one_id": sum(len(out.ids) == 1 for out in streams),
        "wall_s": round(wall_s, 3),
        "resumed_max_gap_s": round(max((out.max_gap_s for out in moved), default=0.0), 3),
        "others_max_gap_s": round(
            max((out.max_gap_s for out in streams if out not in moved), default=0.0), 3
        ),
        "completion_tokens": sum((out.usage or {}).get("completion_tokens", 0) for out in streams),
        "errors": [out.error for out in streams if out.error is not None][:3],
        "texts": [out.text for out in streams],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument(
        "--kill-after", type=int, default=8, help="content events every stream has at the kill"
    )
    parser.add_argument(
        "--backend",
        choices=sorted(ENGINES),
        default="herd",
        help="herd: SmolLM2 on the CPU; simulated: the cost-model engine (tokens a pure function of the prompt)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/resume_kill.json"))
    args = parser.parse_args()
    log_dir = Path("/tmp/herd-resume-kill")
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port_block(2) for _ in range(2)]
    manifest_path = log_dir / "manifest.yaml"
    engine = ENGINES[args.backend]
    manifest_path.write_text(json.dumps(demo_manifest(NAME, engine)))
    gateway_port = free_port()
    url = f"http://{HOST}:{gateway_port}"
    endpoints = [f"http://{HOST}:{port},http://{HOST}:{internal}" for port, internal in ports]
    argv = orchestrator_argv(
        manifest_path, endpoints, token=TOKEN, port=gateway_port, extra=["--log-level", "INFO"]
    )

    def worker(n: int, attempt: int) -> contextlib.AbstractContextManager[HerdWorkers]:
        """Worker ``n`` on its own ports (a restart too: the orchestrator's ``--worker`` names them)."""
        log = log_dir / f"worker{n}-{attempt}.log"
        return herd_workers(DEMO_MODEL, name=NAME, token=TOKEN, engine=engine, log=log, ports=ports[n])

    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        processes = [stack.enter_context(worker(n, 0)).process for n in range(2)]
        stack.enter_context(
            serving(argv, ready_url=f"{url}/health", log=log_dir / "orchestrator.log", env={})
        )
        wait_admitted(url, 2)
        asyncio.run(run_streams(url, argparse.Namespace(**{**vars(args), "output_len": 4}), None))  # warm-up
        for number in range(args.rounds):
            reference: list[Stream] | None = None
            for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                before = resumes(url)
                kill = processes[0].pid if setup == "killed" else None
                streams, wall_s = asyncio.run(run_streams(url, args, kill))
                run = {"round": number, **summarize(setup, streams, reference, wall_s)}
                run["num_resumed"] = resumes(url) - before
                if setup == "undisturbed":
                    reference = streams
                    for earlier in runs:  # a killed run before this one: compare it now
                        if earlier["round"] == number and earlier["setup"] == "killed":
                            earlier.update(
                                summarize("killed", earlier.pop("_streams"), streams, earlier["wall_s"])
                            )
                else:
                    processes[0] = stack.enter_context(worker(0, number + 1)).process
                    wait_admitted(url, 2)
                    if reference is None:
                        run["_streams"] = streams
                print(
                    json.dumps({k: v for k, v in run.items() if k not in ("_streams", "texts")}), flush=True
                )
                runs.append(run)
    killed = [run for run in runs if run["setup"] == "killed"]
    undisturbed = [run for run in runs if run["setup"] == "undisturbed"]
    first = undisturbed[0]["texts"]
    for run in runs:  # the baseline: how often one undisturbed run's text is another's
        run["num_same_as_first_undisturbed"] = sum(a == b for a, b in zip(run["texts"], first, strict=True))
    summary = {
        "killed": {
            "same_as_undisturbed": [run["num_same_as_undisturbed"] for run in killed],
            "same_as_first_undisturbed": [run["num_same_as_first_undisturbed"] for run in killed],
            "complete": [run["num_complete"] for run in killed],
            "on_killed_worker": [run["num_on_killed_worker"] for run in killed],
            "resumed": [run["num_resumed"] for run in killed],
            "median_wall_s": statistics.median(run["wall_s"] for run in killed),
            "wall_s": [run["wall_s"] for run in killed],
            "median_resumed_max_gap_s": statistics.median(run["resumed_max_gap_s"] for run in killed),
            "resumed_max_gap_s": [run["resumed_max_gap_s"] for run in killed],
        },
        "undisturbed": {
            "complete": [run["num_complete"] for run in undisturbed],
            "median_wall_s": statistics.median(run["wall_s"] for run in undisturbed),
            "wall_s": [run["wall_s"] for run in undisturbed],
            "max_gap_s": [run["others_max_gap_s"] for run in undisturbed],
            "same_as_first_undisturbed": [run["num_same_as_first_undisturbed"] for run in undisturbed],
        },
    }
    write_report(args, engine, runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
