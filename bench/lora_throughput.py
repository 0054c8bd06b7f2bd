"""Multi-LoRA throughput: a batch mixing 4 adapters against the base model alone, in process, side by side.

Three setups run the same requests (``--requests`` prompts of ``--prompt-len`` random tokens,
``--output-len`` tokens each with ``ignore_eos``, all in flight at once, greedy):

* ``base``: the base model on an engine without LoRA (``maxLoras: 0``): the reference;
* ``base-lora-on``: the same base-model requests on the LoRA engine (slots allocated, no adapter in
  the batch): what turning LoRA on costs requests that use none;
* ``mixed-4``: the same prompts on the LoRA engine, request ``i`` with adapter ``i % 4`` (four PEFT
  adapters of rank ``--rank`` on every attention and MLP projection, random weights): every step
  runs all four adapters' deltas.

Both engines load the same weights and size the same KV pool; prefix caching is off, so no setup
reuses another's blocks. Each round runs the setups in a rotated order, on fresh prompts (the same
for every setup within a round). Output tokens/s is the requests' output tokens over the wall time
from the first request added to the last one finished; the report gives each setup's median and
spread over the rounds, and ``mixed-4`` over ``base`` per round and in the median. Beside the wall
time it counts the process's CPU time (``output_tok_per_cpu_s``): with ``--threads 1`` on a shared,
oversubscribed machine the wall time includes waits for a core that the CPU time leaves out.

    .venv/bin/python bench/lora_throughput.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import DEMO_MODEL, REPO, machine_info, write_json
from support.lora import make_peft_adapter

from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

ADAPTERS = ("a0", "a1", "a2", "a3")
SETUPS = ("base", "base-lora-on", "mixed-4")


def make_engine(
    model: Path, *, max_loras: int, adapters: dict[str, Path], batch: int, max_rank: int
) -> LLMEngine:
    spec = {
        "device": "cpu",
        "dtype": "float32",
        "maxBatchSize": batch,
        "maxLoras": max_loras,
        "maxLoraRank": max_rank,  # the adapters' rank: slots are padded to it
        "kvCache": {"memoryGiB": 0.5, "prefixCaching": False},
    }
    config = EngineConfig(model_path=model, served_name="bench", engine=spec, lora_modules=adapters)  # type: ignore[arg-type]
    return torch_engine(config)


def run(
    engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], output_len: int
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started, started_cpu = time.perf_counter(), time.process_time()
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{index}-{started}", prompt, params, lora_name=lora)
    num_tokens = num_steps = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(output.new_token_ids) for output in engine.step())
        num_steps += 1
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    return {
        "output_tok_s": round(num_tokens / seconds, 2),
        "output_tok_per_cpu_s": round(num_tokens / cpu_seconds, 2),
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "steps": num_steps,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="herd-lora-bench-") as folder:
        adapters = {
            name: make_peft_adapter(args.model, Path(folder) / name, rank=args.rank, seed=index)
            for index, name in enumerate(ADAPTERS)
        }
        engines = {
            "base": make_engine(
                args.model, max_loras=0, adapters={}, batch=args.requests, max_rank=args.rank
            ),
            "lora": make_engine(
                args.model,
                max_loras=len(ADAPTERS),
                adapters=adapters,
                batch=args.requests,
                max_rank=args.rank,
            ),
        }
        rounds = []
        for number in range(args.rounds):
            rng = random.Random(number)
            prompts = [
                [rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.requests)
            ]
            mixed = [ADAPTERS[index % len(ADAPTERS)] for index in range(args.requests)]
            plans = {
                "base": (engines["base"], [None] * args.requests),
                "base-lora-on": (engines["lora"], [None] * args.requests),
                "mixed-4": (engines["lora"], mixed),
            }
            order = SETUPS[number % 3 :] + SETUPS[: number % 3]
            result = {
                setup: run(plans[setup][0], prompts, plans[setup][1], args.output_len) for setup in order
            }
            result["order"] = list(order)  # type: ignore[assignment]
            print(
                f"round {number + 1}: "
                + ", ".join(
                    f"{s} {result[s]['output_tok_s']} tok/s ({result[s]['output_tok_per_cpu_s']} per CPU s)"
                    for s in SETUPS
                )
            )
            rounds.append(result)
    summary: dict[str, Any] = {}
    for metric in ("output_tok_s", "output_tok_per_cpu_s"):
        summary[metric] = {setup: spread([r[setup][metric] for r in rounds]) for setup in SETUPS}
        ratios = [r["mixed-4"][metric] / r["base"][metric] for r in rounds]
        summary[metric]["mixed_over_base"] = {
            "median": round(statistics.median(ratios), 3),
            "per_round": [round(x, 3) for x in ratios],
        }
    print(summary)
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "args": {
                key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
            },
            "rounds": rounds,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
