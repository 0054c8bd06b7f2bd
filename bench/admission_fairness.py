"""Issue 21's fairness benchmark: two tenants, one sending 10x the other's traffic, both backlogged.

Two simulated workers (``herd worker --replicas 2``, the cost-model engine on the demo model's
config and tokenizer, ``maxBatchSize`` 4 and ``maxQueueLen`` 1, so the gateway holds at most 5
requests on each) behind ``herd orchestrator``. A heavy client keeps ``--heavy`` requests in flight,
a light one ``--light`` (10x fewer); every request is the same completion (``--output-len`` tokens,
``ignore_eos``). Both stay backlogged: the gateway's queue always holds requests of both.

The two setups differ only in the keys file: ``tenants``, the heavy and the light key in two tenants
of equal weight (the gateway's fair queue shares tokens between them), and ``one-tenant``, both keys
in one tenant (the queue is then first come, first served, as any FIFO admission would be). Each
setup gets a fresh orchestrator; the setups alternate over ``--rounds`` rounds. The figure is each
tenant's share of the output tokens that finished inside the measured window (after a warm-up).

    .venv/bin/python bench/admission_fairness.py --rounds 3 --out bench/results/admission_fairness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    demo_manifest,
    free_port,
    herd_workers,
    orchestrator_argv,
    serving,
    write_report,
)

NAME = "sim"
TOKEN = "admission-fairness"
ENGINE = {"backend": "simulated", "maxModelLen": 1024, "maxBatchSize": 4, "maxQueueLen": 1}
SETUPS = {
    "tenants": "tenants:\n  - {name: heavy, keys: [k-heavy]}\n  - {name: light, keys: [k-light]}\n",
    "one-tenant": "tenants:\n  - {name: shared, keys: [k-heavy, k-light]}\n",
}


async def client_loop(
    client: httpx.AsyncClient,
    key: str,
    args: argparse.Namespace,
    window: tuple[float, float],
    tokens: list[int],
) -> None:
    body = {"model": NAME, "prompt": "Tell me a story about a cat. " * 8, "max_tokens": args.output_len}
    body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {key}"}
    while time.monotonic() < window[1]:
        response = await client.post("/v1/completions", json=body, headers=headers)
        if response.status_code != 200:
            await asyncio.sleep(0.05)
            continue
        if window[0] <= time.monotonic() <= window[1]:
            tokens.append(int(response.json()["usage"]["completion_tokens"]))


async def load(url: str, args: argparse.Namespace) -> dict[str, int]:
    start = time.monotonic()
    window = (start + args.warmup_s, start + args.warmup_s + args.seconds)
    served: dict[str, list[int]] = {"heavy": [], "light": []}
    limits = httpx.Limits(max_connections=args.heavy + args.light + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        loops = [client_loop(client, "k-heavy", args, window, served["heavy"]) for _ in range(args.heavy)]
        loops += [client_loop(client, "k-light", args, window, served["light"]) for _ in range(args.light)]
        await asyncio.gather(*loops)
    return {tenant: sum(tokens) for tenant, tokens in served.items()}


def measure(args: argparse.Namespace, setup: str, endpoints: list[str], log_dir: Path) -> dict[str, Any]:
    keys = log_dir / f"{setup}.yaml"
    keys.write_text(SETUPS[setup])
    manifest_path = log_dir / "manifest.yaml"
    manifest_path.write_text(json.dumps(demo_manifest(NAME, ENGINE, replicas=2)))
    port = free_port()
    argv = orchestrator_argv(
        manifest_path, endpoints, token=TOKEN, port=port, extra=["--api-keys-file", str(keys)]
    )
    url = f"http://{HOST}:{port}"
    with serving(argv, ready_url=f"{url}/health", log=log_dir / f"orchestrator-{setup}.log", env={}):
        time.sleep(2.0)  # a few health polls admit both workers
        tokens = asyncio.run(load(url, args))
    total = sum(tokens.values()) or 1
    return {"setup": setup, "tokens": tokens, "share": {tenant: n / total for tenant, n in tokens.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heavy", type=int, default=100, help="requests the heavy tenant keeps in flight")
    parser.add_argument(
        "--light",
        type=int,
        default=10,
        help="requests the light tenant keeps in flight (above half the gateway's 10 slots: backlogged)",
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="the measured window of each run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/admission_fairness.json"))
    args = parser.parse_args()
    log_dir = Path("/tmp/herd-admission-fairness")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    log = log_dir / "workers.log"
    with herd_workers(DEMO_MODEL, name=NAME, token=TOKEN, engine=ENGINE, log=log, replicas=2) as workers:
        for number in range(args.rounds):
            for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                run = {"round": number, **measure(args, setup, workers.endpoints, log_dir)}
                print(json.dumps(run), flush=True)
                runs.append(run)
    summary = {
        setup: {
            tenant: {
                "median_share": statistics.median(
                    run["share"][tenant] for run in runs if run["setup"] == setup
                ),
                "min_share": min(run["share"][tenant] for run in runs if run["setup"] == setup),
                "max_share": max(run["share"][tenant] for run in runs if run["setup"] == setup),
            }
            for tenant in ("heavy", "light")
        }
        for setup in SETUPS
    }
    write_report(args, ENGINE, runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
