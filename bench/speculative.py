"""Speculative decoding in herd's engine, side by side in one run, on an input-grounded workload.

The requests ask the demo model to fix the spelling of a given paragraph and return it, so the
output repeats the input, as editing and summarizing do. Greedy decoding, so every setup emits the
very same tokens (the engine's parity tests say so; this script checks it too) and only the time
differs. ``--workload open`` asks for stories and poems instead, sampled, where prompt lookup rarely guesses
right: speculation's cost without its gain, what the adaptive policy is for. Setups:

* ``none``: no speculation;
* ``ngram-k4``: n-gram prompt lookup proposing 4 tokens at every step (``adaptive: false``);
* ``ngram-adaptive``: the same proposer, the number of tokens chosen per step by the adaptive
  policy from the batch, the measured acceptance and the measured step cost (the default).

Two phases, each alternating the setups over ``--rounds`` rounds (a fresh ``cache_salt`` per round,
so no round reuses another's prefix cache):

1. Concurrency 1: each paragraph alone, the setups back to back per request. Decode tokens/s of a
   request = (output tokens - 1) / (time of its last token - time of its first).
2. Concurrency ``--concurrency``: ``--requests`` requests with that many in flight (a new one
   admitted as one finishes). Output tokens/s over the phase's wall time, and decode tokens/s; and
   output tokens per second of this process's CPU time (``output_tok_per_cpu_s``): the engines run
   on one thread, so on a shared, loaded machine this counts their work without the waits.

The engines run in this process on one torch thread each (``--threads``), built once and kept, so
each setup has its own weights and KV pool; ``engine.speculative`` is the only difference.

    .venv/bin/python bench/speculative.py --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import DEMO_MODEL, REPO, machine_info, write_json

from herd.api.prompt import PromptRenderer
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

PARAGRAPHS = [
    "The operater watches every ModelDeployment and turns it into Deployments and Services, one for "
    "each pool. It keeps the status up to date and scales the pools when the latency goes above its "
    "target, and it never creates an object blindly.",
    "A paged KV cache stores the keys and values of every token in blocks of sixteen tokens. Blocks "
    "that hold the same prefix are shared betwen requests, so a long system prompt is computed once "
    "and reused by every conversation that starts with it.",
    "Continuous batching adds new requests to the running batch at every step. A long prompt is "
    "split into chunks, so that the requests which are already decoding keep recieving tokens while "
    "the prompt is being read.",
    "The gateway routes each request to the worker that already holds the longest part of its prompt "
    "in its cache, unless that worker is much busier than the others. In that case the request goes "
    "to a less loaded worker and the cache is built there.",
    "When a worker stops, the orchestrator notices within a few seconds and sends new requests "
    "elsewhere. Requests that were already running on it fail, and the clients retry them; nothing "
    "is lost that was not in flight on the worker that stoped.",
    "Disaggregated serving runs the prompt on one pool of workers and the decoding on another. The "
    "KV blocks of the prompt move from the first worker to the second over the network, and the "
    "second one streams the answer back to the client.",
]
INSTRUCTION = "Fix the spelling mistakes in the following text and return the whole corrected text:\n\n"
OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a day in the life of a baker in a small mountain village.",
    "Invent a new board game and explain how to win it.",
    "Write a letter from a cat to the dog next door.",
    "Tell me about a city where it rains every afternoon at four.",
    "Write a poem about the first snow of the winter.",
]
"""``--workload open``: nothing to repeat, sampled at temperature 1 (greedy decoding of a small model
loops, and a loop is easy to guess), every request running to ``--max-tokens`` (``ignore_eos``) so
that each setup emits as many tokens; the tokens themselves differ between setups."""
SETUPS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram-k4": {"method": "ngram", "numTokens": 4, "adaptive": False},
    "ngram-adaptive": {"method": "ngram", "numTokens": 4},
}


def build_engine(model: Path, speculative: dict[str, Any] | None) -> LLMEngine:
    engine: dict[str, Any] = {"device": "cpu", "kvCache": {"memoryGiB": 0.5}}
    if speculative is not None:
        engine["speculative"] = speculative
    config = EngineConfig(model_path=model, served_name="bench", engine=engine)  # type: ignore[arg-type]
    return torch_engine(config)


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int, salt: str
) -> dict[str, Any]:
    """Run ``prompts`` with ``concurrency`` in flight; per request its tokens and token times."""
    pending = list(enumerate(prompts))
    times: dict[str, list[float]] = {}
    token_ids: dict[str, list[int]] = {}
    active: set[str] = set()
    started, cpu_started = time.perf_counter(), time.process_time()
    while pending or active:
        while pending and len(active) < concurrency:
            index, prompt = pending.pop(0)
            request_id = f"{salt}-{index}"
            engine.add_request(request_id, prompt, params, cache_salt=salt)
            active.add(request_id)
            times[request_id], token_ids[request_id] = [], []
        for output in engine.step():
            now = time.perf_counter()
            times[output.request_id] += [now] * len(output.new_token_ids)
            token_ids[output.request_id] += output.new_token_ids
            if output.finished:
                active.discard(output.request_id)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    requests = [
        {"tokens": token_ids[request_id], "times": [t - started for t in times[request_id]]}
        for request_id in sorted(times, key=lambda key: int(key.rsplit("-", 1)[1]))
    ]
    return {"wall_s": wall, "cpu_s": cpu, "requests": requests}


def decode_rate(request: dict[str, Any]) -> float:
    times = request["times"]
    return (len(times) - 1) / (times[-1] - times[0])


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    requests = result["requests"]
    num_tokens = sum(len(request["tokens"]) for request in requests)
    decode_tokens = sum(len(request["tokens"]) - 1 for request in requests)
    decode_seconds = sum(request["times"][-1] - request["times"][0] for request in requests)
    return {
        "output_tokens": num_tokens,
        "wall_s": round(result["wall_s"], 2),
        "output_tok_s": round(num_tokens / result["wall_s"], 2),
        "output_tok_per_cpu_s": round(num_tokens / result["cpu_s"], 2),
        "decode_tok_s": round(decode_tokens / decode_seconds, 2),
        "decode_tok_s_p50": round(statistics.median(decode_rate(request) for request in requests), 2),
    }


def spec_counters(engine: LLMEngine) -> dict[str, Any]:
    stats = engine.stats
    return {
        "drafts": stats.spec_num_drafts,
        "draft_tokens": stats.spec_num_draft_tokens,
        "accepted_tokens": stats.spec_num_accepted_tokens,
        "accepted_per_pos": list(stats.spec_accepted_per_pos),
        "steps": stats.num_steps,
    }


def concurrency_one(
    engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams, round_number: int
) -> dict[str, dict[str, Any]]:
    """Each prompt alone through every setup in turn (the setups' order rotates per request)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    names = list(engines)
    for index, prompt in enumerate(prompts):
        shift = (index + round_number) % len(names)
        for name in names[shift:] + names[:shift]:
            salt = f"c1-r{round_number}-p{index}"
            result = run(engines[name], [prompt], params, 1, salt)
            results[name].append(
                result["requests"][0] | {"wall_s": result["wall_s"], "cpu_s": result["cpu_s"]}
            )
    return {
        name: summarize({key: sum(r[key] for r in runs) for key in ("wall_s", "cpu_s")} | {"requests": runs})
        | {"tokens": [r["tokens"] for r in runs]}
        for name, runs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--phases", default="c1,cN", help="c1, cN or both")
    parser.add_argument(
        "--workload", choices=["grounded", "open"], default="grounded", help="open: open-ended requests"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    renderer = PromptRenderer.from_pretrained(args.model)
    texts = [INSTRUCTION + text for text in PARAGRAPHS] if args.workload == "grounded" else OPEN_ENDED
    prompts = [renderer.encode_chat([{"role": "user", "content": text}]) for text in texts]
    params = (
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        if args.workload == "grounded"
        else SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    )
    engines = {name: build_engine(args.model, speculative) for name, speculative in SETUPS.items()}
    phases = args.phases.split(",")
    report: dict[str, Any] = {
        "machine_before": machine_info(),
        "setups": SETUPS,
        "args": vars(args) | {"model": str(args.model), "out": str(args.out)},
        "rounds": [],
    }
    for round_number in range(args.rounds):
        entry: dict[str, Any] = {"round": round_number, "load_average": machine_info()["load_average"]}
        if "c1" in phases:
            entry["c1"] = concurrency_one(engines, prompts, params, round_number)
            print(
                round_number,
                "c1",
                {name: row["decode_tok_s"] for name, row in entry["c1"].items()},
                flush=True,
            )
        if "cN" in phases:
            many = [prompts[index % len(prompts)] for index in range(args.requests)]
            order = list(engines) if round_number % 2 == 0 else list(reversed(engines))
            entry["cN"] = {}
            for name in order:
                result = run(engines[name], many, params, args.concurrency, f"cN-r{round_number}")
                entry["cN"][name] = summarize(result) | {"tokens": [r["tokens"] for r in result["requests"]]}
            print(
                round_number,
                "cN",
                {name: row["output_tok_s"] for name, row in entry["cN"].items()},
                flush=True,
            )
        report["rounds"].append(entry)
        write_json(args.out, finish(report, engines))


def finish(report: dict[str, Any], engines: dict[str, LLMEngine]) -> dict[str, Any]:
    """Medians and spreads over the rounds, ratios to ``none``, the parity check, counters."""
    report = copy.deepcopy(report)
    summary: dict[str, Any] = {}
    for phase, key in (("c1", "decode_tok_s"), ("cN", "output_tok_s"), ("cN", "output_tok_per_cpu_s")):
        rows = [entry[phase] for entry in report["rounds"] if phase in entry]
        if not rows:
            continue
        summary.setdefault(phase, {name: {} for name in engines})
        for name in engines:
            values = [row[name][key] for row in rows]
            ratios = [row[name][key] / row["none"][key] for row in rows]
            summary[phase][name] |= {
                key + "_median": round(statistics.median(values), 2),
                key + "_spread": [min(values), max(values)],
                key + "_ratio_to_none_median": round(statistics.median(ratios), 3),
                key + "_ratio_to_none_spread": [round(min(ratios), 3), round(max(ratios), 3)],
                "same_tokens_as_none": all(row[name]["tokens"] == row["none"]["tokens"] for row in rows),
            }
    for entry in report["rounds"]:
        for phase in ("c1", "cN"):
            for row in entry.get(phase, {}).values():
                row["num_requests"] = len(row.pop("tokens", []))
    return report | {
        "summary": summary,
        "spec_counters": {name: spec_counters(engine) for name, engine in engines.items()},
        "machine_after": machine_info(),
    }


if __name__ == "__main__":
    main()
