"""How many simulated workers fit in one process: ``herd worker --replicas N`` with
``engine.backend: simulated`` on the demo model's config and tokenizer, its resident memory and CPU
share while idle and under light load (requests spread round-robin over every worker, through
``herd bench``'s client).

    .venv/bin/python bench/sim_fleet.py --count 256 --out bench/results/sim_fleet.json

The CPU share is the process's user + system time over wall time in each phase (1.0 = one core).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import DEMO_MODEL, command_line, herd_workers, write_results

ENGINE = {"backend": "simulated", "maxModelLen": 1024, "kvCache": {"memoryGiB": 0.05}}
TOKEN = "sim-fleet"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def _light_load(urls: list[str], seconds: float, concurrency: int) -> dict[str, Any]:
    """Short completions spread round-robin over the workers, ``concurrency`` in flight."""
    deadline = time.monotonic() + seconds
    latencies: list[float] = []
    counter = iter(range(10**9))

    async def loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            url = urls[next(counter) % len(urls)]
            body = {
                "model": "sim",
                "prompt": "Tell me a story about a cat",
                "max_tokens": 8,
                "ignore_eos": True,
            }
            start = time.monotonic()
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            latencies.append(time.monotonic() - start)

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
    latencies.sort()
    return {
        "num_requests": len(latencies),
        "requests_per_s": round(len(latencies) / seconds, 2),
        "e2e_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
    }


def _phase(pid: int, seconds: float, action: Any = None) -> dict[str, Any]:
    cpu, wall = _cpu_seconds(pid), time.monotonic()
    result = asyncio.run(action()) if action else time.sleep(seconds)
    share = (_cpu_seconds(pid) - cpu) / (time.monotonic() - wall)
    return {"cpu_share": round(share, 3), "rss_mib": round(_rss_mib(pid), 1), **(result or {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight under load")
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim_fleet.json"))
    args = parser.parse_args()
    log = Path("/tmp/herd-sim-fleet.log")
    started = time.monotonic()
    fleet = herd_workers(DEMO_MODEL, name="sim", token=TOKEN, engine=ENGINE, log=log, replicas=args.count)
    with fleet as workers:
        ready_s = time.monotonic() - started
        pid, public = workers.process.pid, [url for url, _ in workers.urls]
        idle = _phase(pid, args.seconds)
        loaded = _phase(pid, args.seconds, lambda: _light_load(public, args.seconds, args.concurrency))
        threads = _threads(pid)
    result = {
        "count": args.count,
        "ready_s": round(ready_s, 1),
        "threads": threads,
        "idle": idle,
        "light_load": {"concurrency": args.concurrency, **loaded},
    }
    write_results(args.out, result, command=command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
