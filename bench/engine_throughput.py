"""herd's LLMEngine vs transformers ``generate()``, in process, side by side in one run.

1. Throughput: the same fixed-seed workload (prompts 128-512 tokens, outputs 64-256, ``ignore_eos``)
   through herd's engine with all requests in flight (continuous batching), and through
   ``transformers`` ``generate()`` in static, left-padded batches of ``--concurrency`` that run to the
   longest output of the batch. Output tokens/s counts only the tokens each request asked for; since
   the static batch also computes every shorter request's padding steps, the comparison is made per
   computed token too (``computed_tok_s``: batch rows x steps run; herd computes only what was asked).
   TTFT (from the start of the run) and inter-token latency come from herd's per-step outputs and
   from a streamer that timestamps each ``generate()`` step.
2. Prefix cache: TTFT of a prompt whose 1024-token prefix is cached vs. the same-length prompt cold.

``--herd-only`` runs herd's part of 1 alone: on a tiny model its ``step_ms`` (wall time over steps)
is the engine's own overhead per step, the figure to compare before and after an engine change.
``--decode-batches 4,16`` times herd's decode steps alone instead: at each batch size, prompts of
about ``--decode-context`` tokens are prefilled, then ``--decode-steps`` steps that only decode are
timed one by one (median and p90 of the wall time, and the median of the process's CPU time, which
on a shared machine with ``--threads 1`` counts the work without the waits); compare trees with
``bench/ab.py``.

    .venv/bin/python bench/engine_throughput.py --model .cache/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import DEMO_MODEL, REPO, machine_info, write_json

from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def make_workload(num_requests: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab_size) for _ in range(rng.randint(128, 512))], rng.randint(64, 256))
        for _ in range(num_requests)
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {
        "p50": round(pick(0.5) * 1000, 1),
        "p99": round(pick(0.99) * 1000, 1),
        "mean": round(statistics.fmean(values) * 1000, 1),
    }


def run_herd(engine: LLMEngine, workload: Workload) -> dict[str, Any]:
    start = time.perf_counter()
    for index, (prompt, num_out) in enumerate(workload):
        engine.add_request(
            f"r{index}", prompt, SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True)
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id in last:
                gaps.append(now - last[output.request_id])
            first.setdefault(output.request_id, now - start)
            last[output.request_id] = now
    wall = time.perf_counter() - start
    total = sum(num_out for _, num_out in workload)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": total,
        "output_tok_s": round(total / wall, 2),
        "ttft_ms": percentiles(list(first.values())),
        "itl_ms": percentiles(gaps),
        "num_preemptions": engine.stats.num_preemptions,
        "num_steps": engine.stats.num_steps,
        "step_ms": round(wall / engine.stats.num_steps * 1000, 3),
    }


class _StepClock:
    """A ``generate()`` streamer that only records when each step's tokens came out."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model: Any, workload: Workload, batch_size: int, pad_id: int) -> dict[str, Any]:
    start = time.perf_counter()
    ttfts: list[float] = []
    itls: list[float] = []
    computed = 0
    for offset in range(0, len(workload), batch_size):
        batch = workload[offset : offset + batch_size]
        width = max(len(prompt) for prompt, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        steps = max(num_out for _, num_out in batch)
        computed += steps * len(batch)
        clock = _StepClock()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=clock,
            )
        token_times = clock.times[1:]  # the first put is the prompt itself
        ttfts += [token_times[0] - start] * len(batch)
        for _, num_out in batch:
            itls += [b - a for a, b in itertools.pairwise(token_times[:num_out])]
    wall = time.perf_counter() - start
    total = sum(num_out for _, num_out in workload)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": total,
        "output_tok_s": round(total / wall, 2),
        "computed_tokens": computed,
        "computed_tok_s": round(computed / wall, 2),
        "ttft_ms": percentiles(ttfts),
        "itl_ms": percentiles(itls),
    }


def decode_steps(engine: LLMEngine, batch_size: int, context_len: int, num_steps: int) -> dict[str, Any]:
    """Per-step wall time of ``num_steps`` steps where ``batch_size`` sequences decode, and no prefill."""
    rng = random.Random(batch_size)
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    for index in range(batch_size):
        prompt = [rng.randrange(100, engine.vocab_size) for _ in range(context_len + rng.randint(-16, 16))]
        engine.add_request(f"decode-{batch_size}-{index}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_output_tokens == 0 for seq in scheduler.running):
        engine.step()
    times: list[float] = []
    cpu_times: list[float] = []
    for _ in range(num_steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    while engine.has_unfinished_requests():
        engine.step()
    ordered = sorted(times)
    return {
        "p50": round(statistics.median(times) * 1000, 2),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
        "cpu_p50": round(statistics.median(cpu_times) * 1000, 2),
    }


def prefix_ttft(engine: LLMEngine, vocab_size: int, seed: int, repeats: int) -> dict[str, Any]:
    """TTFT of ``prefix + suffix`` right after the same prefix was served, vs. a never-seen prompt."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]  # noqa: E731
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold: list[float] = []
    warm: list[float] = []
    cached_tokens: list[int] = []
    for _ in range(repeats):
        prefix = tokens(1024)
        for bucket, prompt in ((cold, prefix + tokens(16)), (warm, prefix + tokens(16))):
            started = time.perf_counter()
            [result] = engine.generate([prompt], one)
            bucket.append(time.perf_counter() - started)
        cached_tokens.append(result.num_cached_tokens)
    cold_ms, warm_ms = percentiles(cold), percentiles(warm)
    return {
        "uncached_ttft_ms": cold_ms,
        "cached_ttft_ms": warm_ms,
        "cached_tokens": cached_tokens,
        "speedup_p50": round(cold_ms["p50"] / warm_ms["p50"], 1),
        "target_speedup": 5.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument(
        "--requests", type=int, default=16, help="workload size (the issue's target is a multiple of 16)"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (1 avoids OpenMP spin-waits on a shared machine)",
    )
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--herd-only", action="store_true", help="herd's throughput run alone (step overhead)"
    )
    parser.add_argument("--decode-batches", default="", help="comma-separated batch sizes: decode steps only")
    parser.add_argument("--decode-context", type=int, default=300, help="prompt tokens of the decode run")
    parser.add_argument("--decode-steps", type=int, default=24, help="decode steps timed per batch size")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode_batches:
        run_decode_only(args)
        return
    from transformers import AutoModelForCausalLM

    config = EngineConfig(
        model_path=args.model, served_name="bench", engine={"device": "cpu", "maxBatchSize": args.concurrency}
    )  # type: ignore[arg-type]
    engine = torch_engine(config)
    vocab_size = engine.vocab_size
    workload = make_workload(args.requests, vocab_size, args.seed)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "workload": {
            "requests": args.requests,
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": sum(n for _, n in workload),
        },
    }
    report["herd"] = run_herd(engine, workload)
    print("herd", report["herd"], flush=True)
    if args.herd_only:
        write_json(args.out, report)
        return
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    report["transformers"] = run_transformers(model, workload, args.concurrency, pad_id=0)
    print("transformers", report["transformers"], flush=True)
    herd_tok_s = report["herd"]["output_tok_s"]  # herd computes exactly the tokens asked for
    report["throughput_ratio"] = round(herd_tok_s / report["transformers"]["output_tok_s"], 2)
    report["throughput_ratio_per_computed_token"] = round(
        herd_tok_s / report["transformers"]["computed_tok_s"], 2
    )
    report["target_ratio"] = 1.5
    report["prefix_cache"] = prefix_ttft(torch_engine(config), vocab_size, args.seed + 1, args.prefix_repeats)
    print("prefix", report["prefix_cache"], flush=True)
    report["machine_after"] = machine_info()["load_average"]
    write_json(args.out, report)
    print(
        f"ratio {report['throughput_ratio']}x (target 1.5x), per computed token "
        f"{report['throughput_ratio_per_computed_token']}x; wrote {args.out}"
    )


def run_decode_only(args: argparse.Namespace) -> None:
    """``--decode-batches``: herd's decode step time at each batch size, nothing else."""
    batches = [int(value) for value in args.decode_batches.split(",")]
    config = EngineConfig(
        model_path=args.model, served_name="bench", engine={"device": "cpu", "maxBatchSize": max(batches)}
    )  # type: ignore[arg-type]
    engine = torch_engine(config)
    decode_steps(engine, batches[0], args.decode_context, 4)  # warms up
    report: dict[str, Any] = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    report["decode_step_ms"] = {
        str(batch): decode_steps(engine, batch, args.decode_context, args.decode_steps) for batch in batches
    }
    report["machine_after"] = machine_info()["load_average"]
    print("decode step ms", report["decode_step_ms"], flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
