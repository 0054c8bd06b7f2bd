"""What the worker's HTTP server and async front cost on top of the engine.

The same requests run on the same engine settings and thread count, two ways, alternating for
``--rounds`` rounds in one run (this machine is shared, so its load drifts within minutes):
(1) ``LLMEngine.generate`` in process, all requests added at once (the engine alone);
(2) a ``herd worker`` process driven over HTTP by concurrent streaming ``/v1/completions``
requests (token-id prompts, ``ignore_eos``, so both produce exactly the same number of tokens).
The ratio of output tokens/s is the server's overhead; TTFT and ITL are measured at the client.
Prompts are random token ids, so no request hits the prefix cache in either setting.

    .venv/bin/python bench/worker_server_overhead.py            # writes bench/results/worker_server_overhead.json
    .venv/bin/python bench/worker_server_overhead.py --model PATH --num-requests 4 --output-len 8 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from _common import DEMO_MODEL, REPO, herd_workers, machine_info, write_json

from herd.api.crd import EngineSpec
from herd.api.prompt import PromptRenderer
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

ENGINE = {"device": "cpu", "maxModelLen": 1024, "kvCache": {"memoryGiB": 0.5}}
WARM_UP = [200] * 16


def make_prompts(model: Path, num: int, low: int, high: int, seed: int) -> list[list[int]]:
    """Random token ids, clear of the special tokens at the start of the vocabulary."""
    vocab_size = PromptRenderer.from_pretrained(model).vocab_size
    rng = random.Random(seed)
    first = min(100, vocab_size // 4)
    return [[rng.randrange(first, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(num)]


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49] * 1000, 2), "p99": round(cuts[98] * 1000, 2)}


def load_engine(model: Path) -> LLMEngine:
    config = EngineConfig(model_path=model, served_name="bench", engine=EngineSpec.model_validate(ENGINE))
    engine = torch_engine(config)
    engine.generate([WARM_UP], SamplingParams(max_tokens=2, ignore_eos=True))
    return engine


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    num_tokens = sum(result.num_output_tokens for result in results)
    return {
        "duration_s": round(elapsed, 3),
        "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / elapsed, 2),
    }


async def _one(
    client: httpx.AsyncClient, prompt: list[int], output_len: int
) -> tuple[float, list[float], int]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return arrivals[0] - started, gaps, num_tokens


async def drive(url: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _one(client, WARM_UP, 2)
        started = time.perf_counter()
        runs = await asyncio.gather(*(_one(client, prompt, output_len) for prompt in prompts))
        elapsed = time.perf_counter() - started
    num_tokens = sum(run[2] for run in runs)
    return {
        "duration_s": round(elapsed, 3),
        "output_tokens": num_tokens,
        "output_tokens_per_s": round(num_tokens / elapsed, 2),
        "ttft_ms": percentiles([run[0] for run in runs]),
        "itl_ms": percentiles([gap for run in runs for gap in run[1]]),
    }


def run_rounds(args: argparse.Namespace, prompts: list[list[int]], log_dir: Path) -> list[dict[str, Any]]:
    engine = load_engine(args.model)
    token = secrets.token_hex(8)
    log = log_dir / "worker.log"
    rounds = []
    with herd_workers(
        args.model, name="bench", token=token, engine=ENGINE, log=log, threads=args.threads
    ) as worker:
        url = worker.urls[0][0]
        for _ in range(args.rounds):
            alone = run_engine(engine, prompts, args.output_len)
            served = asyncio.run(drive(url, prompts, args.output_len))
            ratio = round(served["output_tokens_per_s"] / alone["output_tokens_per_s"], 3)
            rounds.append({"engine_in_process": alone, "herd_worker_http": served, "http_over_engine": ratio})
            print(json.dumps(rounds[-1]), flush=True)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", default="64:128", help="low:high prompt tokens")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument("--rounds", type=int, default=3, help="alternating engine/worker rounds")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "worker_server_overhead.json"
    )
    args = parser.parse_args()
    low, high = (int(part) for part in args.prompt_len.split(":"))
    prompts = make_prompts(args.model, args.num_requests, low, high, seed=0)
    torch.set_num_threads(args.threads)
    before = machine_info()
    with tempfile.TemporaryDirectory() as log_dir:
        rounds = run_rounds(args, prompts, Path(log_dir))
    report = {
        "command": "bench/worker_server_overhead.py "
        + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()),
        "machine_before": before,
        "machine_after": machine_info(),
        "rounds": rounds,
        "median_http_over_engine": statistics.median(r["http_over_engine"] for r in rounds),
    }
    write_json(args.out, report)
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
