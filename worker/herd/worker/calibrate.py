"""Fitting the simulated engine's ``CostModel`` to the real engine.

The real engine runs a grid of batch sizes and context lengths (each batch: that many distinct
prompts of that length, prefilled, then decoded for a fixed number of tokens, greedily and ignoring
EOS) on a runner wrapped to time each ``execute``: the runner's share of a step only, since the
simulated engine pays the scheduler, block manager and detokenizer for real. Each timed step is a
sample (sequences in the batch, scheduled tokens, attended context tokens -> seconds).

The fit is in two stages, because a decode step schedules one token a sequence and so cannot tell a
token's cost from a sequence's: the decode steps fix ``stepMs``, the cost of a decoding sequence and
``contextUs`` (least squares of relative errors over the medians of steps of like shape, no negative
term, the context term only where it explains a fifth of the rest's error), then the prefill steps fix
``tokenMs`` as the median cost of their tokens beyond a sequence's first, and ``seqMs`` keeps the
rest of a decoding sequence's cost. ``hostShare`` is the engine thread's CPU time over all the steps'
wall time. Decode steps set the inter-token latency, prefills the time to
first token; each stage takes its own, so the few prefills are not outvoted by the many decodes.
``hostGBps`` and ``diskGBps`` are the restore bandwidths of a host and a disk tier made beside the
runner's pool (the disk's in a temporary folder), each the median of a few timed restores.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from herd.api.crd import CostModel, KVDiskSpec
from herd.api.prompt import PromptRenderer
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.kv_store import TierStore
from herd.worker.kv_tiers import KVMove
from herd.worker.model_runner import TorchRunner
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import Measured, Runner, StepResult
from herd.worker.sampling_params import SamplingParams
from herd.worker.scheduler import SchedulerOutput

if TYPE_CHECKING:
    import torch

    from herd.worker.cache_geometry import CacheGeometry

__all__ = [
    "CalibrationGrid",
    "StepSample",
    "TimedRunner",
    "calibrate",
    "fit_cost_model",
    "measure_steps",
    "measure_tiers",
]

_CONTEXT_BUCKET = 32
"""Tokens of context a sequence per group of decode steps (``_decode_medians``)."""
_CONTEXT_GAIN = 0.2
"""The share of the residual error the context term must remove to be kept (``_fit_decode``)."""
_TIER_PROBES = 5
_TIER_BLOCKS = 16


@dataclass(frozen=True)
class StepSample:
    """One executed step: what it ran, how long the runner took and how much of it this thread
    spent on the CPU."""

    num_seqs: int
    num_tokens: int
    num_context_tokens: int
    seconds: float
    cpu_seconds: float = 0.0


@dataclass(frozen=True)
class CalibrationGrid:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_lens: tuple[int, ...] = (32, 128, 384)
    output_len: int = 16
    warmup_rounds: int = 1
    """Rounds of the grid's first shape run first and left out of the fit."""


@dataclass
class TimedRunner:
    """A ``Runner`` that times each ``execute`` of the runner it wraps."""

    inner: Runner
    samples: list[StepSample] = field(default_factory=list)

    @property
    def geometry(self) -> CacheGeometry:
        return self.inner.geometry

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def measured(self) -> Measured:
        return self.inner.measured

    @property
    def pooling(self) -> PoolingConfig | None:
        return self.inner.pooling

    def move_blocks(self, moves: list[KVMove]) -> None:
        self.inner.move_blocks(moves)

    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        start, start_cpu = time.perf_counter(), time.thread_time()
        results = self.inner.execute(plan)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        context = sum(chunk.start + chunk.num_tokens for chunk in plan.chunks)
        self.samples.append(StepSample(len(plan.chunks), plan.num_tokens, context, elapsed, cpu))
        return results

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.inner.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        self.inner.write_blocks(block_ids, kv)

    def load_lora(self, name: str, path: Path) -> None:
        self.inner.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.inner.unload_lora(name)

    def check_health(self) -> None:
        self.inner.check_health()


def measure_steps(
    config: EngineConfig, grid: CalibrationGrid, seed: int = 0, runner: TorchRunner | None = None
) -> list[StepSample]:
    """Run the grid on herd's torch engine, every step timed, after ``grid.warmup_rounds`` rounds of
    its first shape left out (allocator and kernel warm-up; leaving out the grid's own first steps
    would lose its smallest prefill, whose cost a token is the highest)."""
    renderer = PromptRenderer.from_pretrained(config.model_path)
    timed = TimedRunner(runner or TorchRunner(config, renderer.eos_token_ids))
    engine = LLMEngine(config, timed, renderer)
    _run_grid(engine, timed, grid, random.Random(seed))
    return timed.samples


def measure_tiers(runner: TorchRunner) -> dict[str, float]:
    """GB a second restored from a host and a disk tier beside ``runner``'s pool (median of a few)."""
    pool = runner.kv_cache
    block_gib = pool[:, :, 0].numel() * pool.element_size() / 2**30
    with tempfile.TemporaryDirectory(prefix="herd-calibrate-") as folder:
        rates: dict[str, list[float]] = {"host": [], "disk": []}
        disk = KVDiskSpec(path=folder, size_gib=block_gib * _TIER_BLOCKS * 1.01)
        for _ in range(_TIER_PROBES):
            measured = Measured()
            store = TierStore.create(pool, _TIER_BLOCKS, disk, measured)
            store.probe()
            store.drop_disk()
            for medium, rate in measured.restore.items():
                if rate.per_second is not None:
                    rates[medium].append(rate.per_second / 1e9)
    return {medium: round(statistics.median(values), 3) for medium, values in rates.items() if values}


def _run_grid(engine: LLMEngine, runner: TimedRunner, grid: CalibrationGrid, rng: random.Random) -> None:
    shapes = [(batch, length) for length in grid.context_lens for batch in grid.batch_sizes]
    for number, (batch, length) in enumerate([shapes[0]] * grid.warmup_rounds + shapes):
        if number == grid.warmup_rounds:
            runner.samples.clear()
        _run_batch(engine, rng, f"calibrate-{number}", batch, length, grid.output_len)


def _run_batch(
    engine: LLMEngine, rng: random.Random, name: str, batch: int, length: int, output_len: int
) -> None:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        # Random ids share no prefix, so every prompt is computed in full.
        prompt = [rng.randrange(engine.vocab_size) for _ in range(length)]
        engine.add_request(f"{name}-{index}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def fit_cost_model(samples: list[StepSample]) -> CostModel:
    """The cost model of the samples: the decode steps fix the step, sequence and context terms,
    then the steps with a prefill fix the cost of each token beyond a sequence's first."""
    decode = [s for s in samples if s.num_tokens == s.num_seqs]
    prefill = [s for s in samples if s.num_tokens > s.num_seqs]
    if not decode or not prefill:
        raise ValueError("calibration needs decode steps and prefill steps: run a grid with both")
    step_ms, per_seq_ms, context_us = _fit_decode(_decode_medians(decode))
    decode_model = CostModel(step_ms=step_ms, seq_ms=per_seq_ms, token_ms=0.0, context_us=context_us)
    extra_ms = [
        (s.seconds - decode_model.step_seconds(s.num_tokens, s.num_seqs, s.num_context_tokens))
        * 1000.0
        / (s.num_tokens - s.num_seqs)
        for s in prefill
    ]
    token_ms = max(0.0, float(np.median(extra_ms)))
    # A decode sequence's one token is in per_seq_ms already: the sequence term keeps the rest.
    terms = {"step_ms": step_ms, "seq_ms": max(0.0, per_seq_ms - token_ms), "token_ms": token_ms}
    terms |= {"context_us": context_us, "host_share": _host_share(samples)}
    return CostModel(**{name: round(value, 4) for name, value in terms.items()})


def _host_share(samples: list[StepSample]) -> float:
    """The engine thread's CPU time over the steps' wall time, at most 1 (with more than one torch
    thread, the others' CPU time is not this thread's)."""
    wall = sum(s.seconds for s in samples)
    return min(1.0, sum(s.cpu_seconds for s in samples) / wall) if wall > 0 else 0.0


def _fit_decode(medians: list[tuple[int, float, float]]) -> list[float]:
    """``[stepMs, ms a decoding sequence, contextUs]``. The context term is kept only where it
    explains at least ``_CONTEXT_GAIN`` of what the other two leave: over short contexts its cost
    drowns in a busy machine's noise, and a term fitted to noise takes from the others at random."""
    rows = np.array([[1.0, seqs, context / 1000.0] for seqs, context, _ in medians])
    target_ms = np.array([ms for _, _, ms in medians])
    with_context = _nonnegative_fit(rows, target_ms)
    without = [*_nonnegative_fit(rows[:, :2], target_ms), 0.0]
    residuals = [_relative_residual(rows, target_ms, fit) for fit in (with_context, without)]
    return with_context if residuals[0] <= (1.0 - _CONTEXT_GAIN) * residuals[1] else without


def _relative_residual(rows: np.ndarray, target_ms: np.ndarray, coefficients: list[float]) -> float:
    return float(np.sum(((rows @ np.array(coefficients) - target_ms) / target_ms) ** 2))


def _decode_medians(decode: list[StepSample]) -> list[tuple[int, float, float]]:
    """Decode steps grouped by batch size and by ``_CONTEXT_BUCKET`` tokens of context a sequence:
    each group's median context and milliseconds. A busy machine's slow steps are spikes; the
    medians leave them out, as the latency percentiles the simulation is held to do."""
    groups: dict[tuple[int, int], list[StepSample]] = {}
    for sample in decode:
        bucket = sample.num_context_tokens // sample.num_seqs // _CONTEXT_BUCKET
        groups.setdefault((sample.num_seqs, bucket), []).append(sample)
    return [
        (
            seqs,
            float(np.median([s.num_context_tokens for s in group])),
            float(np.median([s.seconds for s in group])) * 1000.0,
        )
        for (seqs, _), group in sorted(groups.items())
    ]


def _nonnegative_fit(rows: np.ndarray, target_ms: np.ndarray) -> list[float]:
    """Least squares of relative errors (rows weighted by 1/time); a coefficient that comes out
    negative is dropped and the rest refitted, since no part of a step takes negative time."""
    weights = 1.0 / np.maximum(target_ms, 1e-3)
    kept = list(range(rows.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(rows[:, kept] * weights[:, None], target_ms * weights, rcond=None)
        if all(value >= 0 for value in solution):
            break
        kept.pop(int(np.argmin(solution)))
    coefficients = [0.0] * rows.shape[1]
    for index, value in zip(kept, solution, strict=True):
        coefficients[index] = float(value)
    return coefficients


def calibrate(config: EngineConfig, grid: CalibrationGrid) -> CostModel:
    """The cost model of the torch engine on ``config``: its steps', then its tiers' restores."""
    runner = TorchRunner(config, PromptRenderer.from_pretrained(config.model_path).eos_token_ids)
    cost = fit_cost_model(measure_steps(config, grid, runner=runner))
    bandwidth = measure_tiers(runner)
    return cost.model_copy(update={f"{medium}_gbps": value for medium, value in bandwidth.items()})
