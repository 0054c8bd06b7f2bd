"""The cost-model runner: herd's real engine (scheduler, block manager, prefix cache, KV events)
stepping without a model.

A step costs what the ``CostModel`` (``herd.api.crd``: the manifest's ``engine.simulation.costModel``)
makes of its batch size, scheduled tokens and attended context, spent on a clock: a ``VirtualClock``
only adds it up (a simulation runs as fast as the engine plans, deterministically), a
``SleepingClock`` spends it in real time (a simulated worker process that answers in real time):
the cost model's ``hostShare`` of it busy on the CPU, the rest asleep. The sampled
token of a sequence is a hash of the runner's seed, its prompt (with the cache salt and model that
its root hash carries) and its position, so equal prompts continue alike, as under greedy decoding;
never one of ``avoid_token_ids`` (the stop tokens), unless ``eos_after`` asks for a stop token after that many
output tokens. A constrained sequence (``response_format``, tools) draws the same hash over the tokens
its grammar allows at that step (``herd.worker.grammar``), a stop token only when nothing else is
allowed, so its output matches its grammar as a real model's does. The KV pool is block ids only: the block manager hands them out as for a real pool;
``read_blocks`` answers zeros of the geometry's shape (a placeholder of the right layout, so a KV
frame encodes) and ``write_blocks`` checks that shape and keeps nothing; block copies are no-ops.

Speculative decoding runs with the n-gram proposer, for real: the proposals are looked up in the
sequence's tokens, each one verified against the token this runner would sample at its position
(accepted while they agree, then the runner's own), and a step costs its proposed tokens like any
other. A draft model cannot run where there is no model: ``simulated_engine`` refuses one.

The tiers below the pool are slots too: a plan's moves between them cost their bytes over the cost
model's ``hostGBps`` (device <-> host) or ``diskGBps`` (to or from the disk), added to the step, but
for the disk writes, which go behind the step as the engine's do: each takes the disk its time after
the one queued before it, and a step waits only for room in a full queue (the engine's depth). Disk
reads are charged in full, also of a block still queued (the engine reads that one from memory). The
runner reports the rates it models as measured, so a simulated fleet routes on the same figures.
A LoRA adapter is a name and nothing more: its folder is not read, and a sequence's adapter
changes its tokens only through the root hash, as it changes its blocks' hashes.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from array import array
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from herd.api.crd import CostModel
from herd.api.prompt import PromptRenderer
from herd.api.protocol import Medium
from herd.worker.cache_geometry import CacheGeometry, bytes_per_block, tier_blocks
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.grammar import MaskFiller, allowed_token_ids
from herd.worker.kv_tiers import KVMove, disk_write_queue_depth
from herd.worker.loader import read_model_args
from herd.worker.model_runner import DEFAULT_CPU_KV_GIB
from herd.worker.outputs import TokenLogprob
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import Measured, SampledToken, SpeculatedTokens, StepResult
from herd.worker.scheduler import SchedulerOutput
from herd.worker.sequence import Sequence
from herd.worker.speculative.proposer import NgramProposer, Proposal

__all__ = [
    "Clock",
    "CostModel",
    "DiskWrites",
    "SimulatedRunner",
    "SleepingClock",
    "VirtualClock",
    "simulated_engine",
    "step_seconds",
]


class Clock(Protocol):
    @property
    def now(self) -> float:
        """Seconds since some start, as the clock counts them."""

    def advance(self, seconds: float, host_share: float = 0.0) -> None:
        """Spend a step of ``seconds``, ``host_share`` of it working on the host's CPU."""


@dataclass
class VirtualClock:
    """Simulated seconds; a discrete-event simulation sets ``now`` to an event's time before a step."""

    now: float = 0.0

    def advance(self, seconds: float, host_share: float = 0.0) -> None:
        self.now += seconds


class SleepingClock:
    """Real time: a step takes as long as the cost model says, ``host_share`` of it spinning.

    The spin counts this thread's CPU time, not the wall clock: like the real engine's work it is
    delayed by whatever takes the core or the GIL from it (the worker's own server detokenizing
    and streaming, another process), and while it runs it holds both, as the real step's Python
    does. The rest of the step sleeps, as a host does while its accelerator computes.
    """

    @property
    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float, host_share: float = 0.0) -> None:
        busy = seconds * host_share
        deadline = time.thread_time() + busy
        while time.thread_time() < deadline:
            pass
        time.sleep(seconds - busy)


class DiskWrites:
    """The engine's write-behind disk queue, modelled: a write queued at ``now`` is done
    ``seconds`` after the one before it; a write that finds ``depth`` writes queued waits for the
    oldest one."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._done: deque[float] = deque()  # when each queued write is done, oldest first

    def queue(self, now: float, seconds: float) -> float:
        """Queue a write at ``now``; how long its step waits for room."""
        while self._done and self._done[0] <= now:
            self._done.popleft()
        wait = self._done.popleft() - now if len(self._done) >= self.depth else 0.0
        start = max(now + wait, self._done[-1] if self._done else 0.0)
        self._done.append(start + seconds)
        return wait


def step_seconds(cost: CostModel, plan: SchedulerOutput, num_proposed: int = 0) -> float:
    """The plan's modelled duration: each chunk attends to its sequence's context up to its end;
    ``num_proposed`` tokens verified after their chunks cost as many more tokens."""
    num_context_tokens = sum(chunk.start + chunk.num_tokens for chunk in plan.chunks) + num_proposed
    return cost.step_seconds(plan.num_tokens + num_proposed, len(plan.chunks), num_context_tokens)


class SimulatedRunner:
    """A ``Runner`` that spends a modelled time per step and samples deterministic tokens."""

    def __init__(
        self,
        geometry: CacheGeometry,
        vocab_size: int,
        *,
        cost: CostModel | None = None,
        clock: Clock | None = None,
        avoid_token_ids: Collection[int] = (),
        eos_after: int | None = None,
        seed: int = 0,
        proposer: NgramProposer | None = None,
    ) -> None:
        self.geometry = geometry
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.pooling: PoolingConfig | None = None  # it models generation only
        self.cost = cost or CostModel()
        self.clock = clock or VirtualClock()
        self.measured = Measured()
        tiers: tuple[tuple[Medium, int], ...] = (
            ("host", geometry.num_host_blocks),
            ("disk", geometry.num_disk_blocks),
        )
        for medium, count in tiers:
            if count:  # the real runner's probe at start, as the cost model has it
                seconds = self.cost.move_seconds(geometry.bytes_per_block, disk=medium == "disk")
                self.measured.add_restore(medium, geometry.bytes_per_block, seconds)
        self.disk_writes = DiskWrites(
            disk_write_queue_depth(geometry.num_disk_blocks, geometry.bytes_per_block)
        )
        self.eos_after = eos_after
        self._seed = seed.to_bytes(8, "little", signed=True)
        self._prompt_keys: weakref.WeakKeyDictionary[Sequence, bytes] = weakref.WeakKeyDictionary()
        self._avoid = sorted(set(avoid_token_ids))
        avoided = set(self._avoid)
        self._allowed = [token_id for token_id in range(vocab_size) if token_id not in avoided]

    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """Spend the plan's cost (its moves' and its forward's, proposed tokens included) on the
        clock; one token per sampled chunk, or a verified proposal's tokens. ``block_copies`` move no
        data: the pool holds none."""
        proposals = self.proposer.propose(plan) if self.proposer is not None else {}
        num_proposed = sum(len(proposal.token_ids) for proposal in proposals.values())
        seconds = step_seconds(self.cost, plan, num_proposed)
        self.measured.add_step(plan.num_tokens, seconds)
        self.clock.advance(self._moves_seconds(plan.kv_moves) + seconds, self.cost.host_share)
        sampled = [chunk for chunk in plan.chunks if chunk.is_sampled]
        allowed = self._grammar_allowed([chunk.seq for chunk in sampled])
        return [
            self._verify(chunk.seq, proposals[chunk])
            if chunk in proposals
            else self._sample(chunk.seq, allowed.get(row))
            for row, chunk in enumerate(sampled)
        ]

    def _verify(self, seq: Sequence, proposal: Proposal) -> StepResult:
        """Accept the proposed ids while they are the ones this runner samples, then its own (a
        grammar-constrained sequence is never proposed for)."""
        tokens: list[SampledToken] = []
        for offset in range(len(proposal.token_ids) + 1):
            own = self._sample(seq, offset=offset)
            if not isinstance(own, SampledToken):
                return own
            tokens.append(own)
            if offset == len(proposal.token_ids) or own.token_id != proposal.token_ids[offset]:
                break
        return SpeculatedTokens(tuple(tokens), len(proposal.token_ids))

    def move_blocks(self, moves: list[KVMove]) -> None:
        self.clock.advance(self._moves_seconds(moves), self.cost.host_share)

    def _moves_seconds(self, moves: list[KVMove]) -> float:
        """The time the moves hold the step (a disk write's, only while the queue is full); each
        restore's is recorded as measured."""
        total, now = 0.0, self.clock.now
        for move in moves:
            seconds = self.cost.move_seconds(
                self.geometry.bytes_per_block, disk="disk" in (move.src, move.dst)
            )
            if move.dst == "device":
                self.measured.add_restore(move.src, self.geometry.bytes_per_block, seconds)
            total += self.disk_writes.queue(now + total, seconds) if move.dst == "disk" else seconds
        return total

    def _grammar_allowed(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """The tokens each constrained sequence's grammar allows now, by its row."""
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        matchers = [grammar for seq in seqs if (grammar := seq.grammar) is not None]
        if not matchers:
            return {}
        bitmask = MaskFiller.fill_now(matchers)
        return {row: allowed_token_ids(bitmask[i], self.vocab_size) for i, row in enumerate(rows)}

    def _sample(
        self, seq: Sequence, grammar_allowed: list[int] | None = None, *, offset: int = 0
    ) -> StepResult:
        """The token at output position ``seq.num_output_tokens + offset``."""
        position = seq.num_output_tokens + offset
        candidates = self._allowed
        if grammar_allowed is not None:
            avoided = set(self._avoid)
            candidates = [
                token_id for token_id in grammar_allowed if token_id not in avoided
            ] or grammar_allowed
            if not candidates:
                return ValueError("the output's grammar allows no token here")
        if (
            self.eos_after is not None
            and position >= self.eos_after
            and self._avoid
            and grammar_allowed is None
        ):
            token_id = self._avoid[0]
        else:
            digest = hashlib.blake2b(
                self._prompt_key(seq), digest_size=8, salt=position.to_bytes(16, "little")
            ).digest()
            token_id = candidates[int.from_bytes(digest, "little") % len(candidates)]
        num_top = seq.params.logprobs
        logprob = None if num_top is None else TokenLogprob(token_id, 0.0, ((token_id, 0.0),)[:num_top])
        return SampledToken(token_id, logprob)

    def _prompt_key(self, seq: Sequence) -> bytes:
        """The seed and the prompt hashed once per sequence (a key dropped with the sequence)."""
        key = self._prompt_keys.get(seq)
        if key is None:
            prompt = array("q", seq.prompt_token_ids).tobytes()
            key = hashlib.blake2b(seq.root_hash.to_bytes(8, "little") + prompt, key=self._seed).digest()
            self._prompt_keys[seq] = key
        return key

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return torch.zeros(self._shape(len(block_ids)), dtype=self.geometry.dtype)

    def load_lora(self, name: str, path: Path) -> None:
        """Nothing to read: the cost model has no weights (the engine keeps the name)."""

    def unload_lora(self, name: str) -> None:
        """Nothing to drop."""

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        expected = self._shape(len(block_ids))
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not fit this pool's {expected}")

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        layers, kv, _, block_size, heads, head_dim = self.geometry.shape
        return (layers, kv, num_blocks, block_size, heads, head_dim)

    def check_health(self) -> None:
        """Nothing can break: there is no device."""

    def close(self) -> None:
        """Nothing runs beside it."""


def simulated_engine(
    config: EngineConfig,
    *,
    num_blocks: int | None = None,
    cost: CostModel | None = None,
    clock: Clock | None = None,
    renderer: PromptRenderer | None = None,
) -> LLMEngine:
    """herd's engine on a cost-model runner with a pool of ``num_blocks`` blocks.

    Only the model folder's ``config.json`` is read (the KV layout and vocabulary the worker
    announces are the real model's) and its tokenizer, unless ``renderer`` is given (a simulation
    of many workers may share one); no weights are loaded. By default the pool holds as many blocks
    as the torch runner's on a CPU (``kvCache.memoryGiB``, else 1 GiB), so that both evict alike,
    and the cost is the manifest's ``engine.simulation.costModel``.
    """
    args = read_model_args(config.model_path)
    dtype = config.resolve_dtype(args.checkpoint_dtype)
    per_block = bytes_per_block(args, config.block_size, dtype)
    spec = config.engine.kv_cache
    budget_gib = spec.memory_gib or DEFAULT_CPU_KV_GIB
    geometry = CacheGeometry(
        num_blocks=num_blocks or int(budget_gib * 2**30) // per_block,
        block_size=config.block_size,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        bytes_per_block=per_block,
        num_host_blocks=tier_blocks(spec.host_memory_gib, per_block),
        num_disk_blocks=tier_blocks(spec.disk.size_gib, per_block) if spec.disk is not None else 0,
    )
    renderer = renderer or PromptRenderer.from_pretrained(config.model_path)
    simulation = config.engine.simulation
    runner = SimulatedRunner(
        geometry,
        args.vocab_size,
        cost=cost or (simulation.cost_model if simulation is not None else None),
        clock=clock,
        avoid_token_ids=renderer.eos_token_ids,
        seed=config.seed,
        proposer=_ngram_proposer(config),
    )
    if isinstance(runner.clock, VirtualClock):
        virtual = runner.clock
        return LLMEngine(config, runner, renderer, clock=lambda: virtual.now)
    return LLMEngine(config, runner, renderer)


def _ngram_proposer(config: EngineConfig) -> NgramProposer | None:
    spec = config.engine.speculative
    if spec is None:
        return None
    if spec.method != "ngram":
        raise ValueError(
            f"engine.speculative.method {spec.method} needs a model to run: the simulated engine has none; "
            "use method ngram"
        )
    return NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
