"""Throughput of a batch with half its requests grammar-constrained vs. the same batch all free (issue 15).

One engine (herd's, torch runner) serves both setups, alternated over ``--rounds`` rounds:

* ``free``: ``--batch`` requests, all in flight together, each generating exactly ``--max-tokens``
  tokens (``ignore_eos``), greedy.
* ``half_constrained``: the same prompts and lengths, but every other request carries a
  ``response_format`` JSON schema (an object holding an array of at least 10,000 short strings, so
  its output is JSON that runs to ``--max-tokens``; two schemas alternate, compiled once like the
  server's cache does). Each step then computes those requests' token bitmasks (llguidance) beside
  the forward pass and masks their logits.

Both setups run the same number of steps and output tokens; the ratio of their output tokens/s is
the grammar's cost. Reported per setup: median, min and max over the rounds, and the ratio of
medians. The compile time of the two schemas is reported apart (the first constrained round pays
it; the server compiles on its prompt threads, outside the steps).

    .venv/bin/python bench/structured_throughput.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from _common import DEMO_MODEL, REPO, machine_info, write_json

from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

PROMPT = "List the names of every city you know, as JSON."


def long_schema(key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            key: {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 10_000}
        },
        "required": [key],
        "additionalProperties": False,
    }


def run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, float]:
    prompt = engine.renderer.encode(PROMPT)
    started = time.perf_counter()
    steps_before = engine.stats.num_steps
    outputs = engine.generate([prompt] * len(params), params)
    seconds = time.perf_counter() - started
    num_tokens = sum(output.num_output_tokens for output in outputs)
    assert all(output.error is None for output in outputs), [output.error for output in outputs]
    return {
        "seconds": seconds,
        "output_tokens": num_tokens,
        "output_tok_s": num_tokens / seconds,
        "steps": engine.stats.num_steps - steps_before,
    }


def setups(grammars: list[CompiledGrammar], batch: int, max_tokens: int) -> dict[str, list[SamplingParams]]:
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammars[i // 2 % len(grammars)])
        if i % 2
        else free
        for i in range(batch)
    ]
    return {"free": [free] * batch, "half_constrained": constrained}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "structured_throughput.json")
    args = parser.parse_args()

    config = EngineConfig(
        model_path=args.model,
        served_name="bench",
        engine={"device": args.device, "maxBatchSize": args.batch, "kvCache": {"memoryGiB": 1}},  # type: ignore[arg-type]
    )
    engine = torch_engine(config)
    renderer = engine.renderer
    compiler = GrammarCompiler(
        renderer.tokenizer.to_str(), max(engine.vocab_size, renderer.vocab_size), renderer.eos_token_ids
    )
    started = time.perf_counter()
    grammars = [
        compiler.compile(GrammarSpec.json_schema(long_schema(key), "response_format"))
        for key in ("cities", "towns")
    ]
    compile_s = time.perf_counter() - started
    plans = setups(grammars, args.batch, args.max_tokens)
    run(engine, plans["free"][:2])  # warm-up: first-call allocations out of the measured rounds
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    for number in range(args.rounds):
        order = list(plans) if number % 2 == 0 else list(reversed(plans))  # alternate who goes first
        for name in order:
            result = run(engine, plans[name])
            rounds[name].append(result)
            print(
                f"round {number + 1} {name}: {result['output_tok_s']:.1f} tok/s ({result['steps']} steps)",
                flush=True,
            )
    report = {
        "command": f"bench/structured_throughput.py --batch {args.batch} --max-tokens {args.max_tokens} --rounds {args.rounds}",
        "model": str(args.model.name),
        "device": args.device,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "grammar_compile_s": compile_s,
        "setups": {
            name: {"output_tok_s": summary([r["output_tok_s"] for r in rs]), "rounds": rs}
            for name, rs in rounds.items()
        },
        "machine": machine_info(),
    }
    free = report["setups"]["free"]["output_tok_s"]["median"]
    constrained = report["setups"]["half_constrained"]["output_tok_s"]["median"]
    report["ratio_half_constrained_to_free"] = constrained / free
    write_json(args.out, report)
    print(
        f"half constrained / free = {constrained / free:.3f} (medians {constrained:.1f} / {free:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
