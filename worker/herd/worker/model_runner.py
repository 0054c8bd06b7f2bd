"""The torch runner: loads the model, allocates the KV pool from a memory budget, runs and samples plans.

The pool's size is measured here and returned as a ``CacheGeometry`` (the block manager is built
from it): an explicit ``kvCache.memoryGiB``, else on CUDA the free memory above the share
``1 - memoryUtilization`` of the device left for activations, else 1 GiB on CPU. A step copies
the plan's blocks, starts the grammar masks of its constrained sequences on a side thread, runs one
batched forward over every chunk, and samples the rows whose chunk reached its sequence's end
(``herd.worker.sampler``). The tiers below the pool (``kvCache.hostMemoryGiB``, ``kvCache.disk``) are
``herd.worker.kv_store``'s; a step makes its plan's moves between them first. ``torch_engine`` builds
herd's engine on it.

With ``engine.speculative`` the runner also owns a proposer (``herd.worker.speculative``): n-gram
lookup, or a draft model whose own KV pool, sized block for block with the target's, shares the
memory budget. The proposals enter the same forward after their chunks' tokens (under tensor
parallelism, in the inputs every rank gets), and the sampler verifies them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
from collections.abc import Collection, Sequence
from datetime import timedelta
from functools import partial
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from herd.api.prompt import PromptRenderer
from herd.worker.cache_geometry import CacheGeometry, bytes_per_block, tier_blocks
from herd.worker.config import EngineConfig
from herd.worker.embedding_runner import EmbeddingRunner
from herd.worker.engine import LLMEngine
from herd.worker.grammar import MaskFiller, PendingMasks
from herd.worker.input_batch import StepInputs, prepare_inputs
from herd.worker.kv_store import TierStore
from herd.worker.kv_tiers import KVMove
from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.torch_attention import TorchAttentionBackend
from herd.worker.loader import is_encoder, load_model, read_model_args
from herd.worker.lora_model import LoraModel
from herd.worker.models import ModelArgs, UnsupportedModelError
from herd.worker.models.llama import SINGLE, LlamaForCausalLM, local_heads
from herd.worker.parallel import (
    TensorParallel,
    announce,
    await_ranks,
    connect_store,
    exit_with_parent,
    join,
    listen,
    rank_device,
)
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import Measured, StepResult
from herd.worker.sampler import Sampler
from herd.worker.scheduler import ScheduledChunk, SchedulerOutput
from herd.worker.speculative.draft_model import DraftModelProposer
from herd.worker.speculative.proposer import NgramProposer, Proposal, Proposer

__all__ = ["DEFAULT_CPU_KV_GIB", "TorchRunner", "follow_leader", "torch_engine"]

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_GIB = 1.0
LOOPBACK = "127.0.0.1"
_CPU = torch.device("cpu")


def torch_engine(config: EngineConfig) -> LLMEngine:
    """herd's engine on the model at ``config.model_path``: its renderer, weights and KV pool (an
    encoder runs on the ``EmbeddingRunner`` and answers embeddings)."""
    renderer = PromptRenderer.from_pretrained(config.model_path)
    embeds = is_encoder(config.model_path)
    task = config.engine.task
    if task != "auto" and (task == "embed") != embeds:
        kind = "an encoder, which herd runs as an embedding model" if embeds else "a generation model"
        raise UnsupportedModelError(
            f"engine.task is {task} but {config.model_path} holds {kind}: set engine.task to auto or "
            f"{'embed' if embeds else 'generate'}, or serve another model (herd embeds with BERT encoders)"
        )
    if embeds:
        if config.tensor_parallel_size > 1:
            raise UnsupportedModelError(
                "an embedding model runs on one device: leave engine.tensorParallelSize at 1"
            )
        if config.engine.speculative is not None:
            raise UnsupportedModelError(
                f"engine.speculative applies to generation, and {config.model_path} holds an encoder "
                "(an embedding model decodes nothing): remove engine.speculative"
            )
        return LLMEngine(config, EmbeddingRunner(config), renderer)
    if config.tensor_parallel_size == 1:
        return LLMEngine(config, TorchRunner(config, renderer.eos_token_ids), renderer)
    _check_parallel(config)
    return LLMEngine(config, _parallel_runner(config, renderer.eos_token_ids), renderer)


def _check_parallel(config: EngineConfig) -> None:
    """Tensor parallelism splits each projection and the KV pool over ranks; LoRA slots and the KV
    tiers below the pool are not split yet, so a worker asked for both is refused by name."""
    kv_cache = config.engine.kv_cache
    unsplit = [
        *(["LoRA adapters (engine.maxLoras)"] if config.max_loras else []),
        *(["a host KV tier (engine.kvCache.hostMemoryGiB)"] if kv_cache.host_memory_gib else []),
        *(["a disk KV tier (engine.kvCache.disk)"] if kv_cache.disk is not None else []),
    ]
    if unsplit:
        raise UnsupportedModelError(
            f"engine.tensorParallelSize {config.tensor_parallel_size} cannot run with {' or '.join(unsplit)}: "
            "herd splits neither over ranks yet; set engine.tensorParallelSize to 1 or leave those out"
        )


def _parallel_runner(config: EngineConfig, eos_token_ids: Collection[int]) -> TorchRunner:
    """Rank 0's runner. The other ranks of its pod start beside it as processes (``_follow``); the
    ranks of the group's other pods join its store from their own ``herd worker`` (``follow_leader``).
    A rank that has not joined within the group's join timeout fails the load with its number."""
    size, group = config.tensor_parallel_size, config.group
    store = listen(size, group.bind_host, port=group.port if group.size > 1 else 0)
    followers = _start_ranks(config, range(1, config.ranks_per_pod), f"{LOOPBACK}:{store.port}")
    try:
        await_ranks(store, size, partial(_check_started, followers), timedelta(seconds=group.join_timeout_s))
        parallel = join(store, 0, size, rank_device(config.device, 0), group.gloo_host)
        logger.info(
            "tensor-parallel ranks joined",
            extra={"num_ranks": size, "num_pods": group.size, "pids": [f.pid for f in followers]},
        )
        return TorchRunner(config, eos_token_ids, parallel=parallel, followers=followers)
    except BaseException:
        for follower in followers:
            follower.kill()
        raise


def follow_leader(config: EngineConfig) -> None:
    """A follower pod's worker (``config.group.index`` > 0): this pod's ranks join the leader's store,
    load their slices and run every step rank 0 sends. Returns when rank 0 closes (its worker
    stopped); raises when the leader cannot be reached or its connection breaks mid-step."""
    _check_parallel(config)
    group, size = config.group, config.tensor_parallel_size
    first = group.index * config.ranks_per_pod
    store = connect_store(group.leader_host, group.port, size, timedelta(seconds=group.join_timeout_s))
    followers = _start_ranks(
        config, range(first + 1, first + config.ranks_per_pod), f"{group.leader_host}:{group.port}"
    )
    try:
        announce(store, first)
        parallel = join(store, first, size, rank_device(config.device, 0), group.gloo_host)
        logger.info(
            "joined the leader's ranks", extra={"rank": first, "num_ranks": size, "leader": group.leader_host}
        )
        runner = TorchRunner(config, (), parallel=parallel, followers=followers)
    except BaseException:
        for follower in followers:
            follower.kill()
        raise
    runner.follow()
    runner.close()


def _start_ranks(config: EngineConfig, ranks: range, address: str) -> list[BaseProcess]:
    """A process for each of ``ranks`` (this pod's other ranks), meeting at the store at ``address``."""
    context = multiprocessing.get_context("spawn")  # a fork of a process holding torch's threads hangs
    followers: list[BaseProcess] = [
        context.Process(
            target=_follow, args=(config, rank, address, os.getpid()), name=f"herd-rank-{rank}", daemon=True
        )
        for rank in ranks
    ]
    for follower in followers:
        follower.start()
    return followers


def _check_started(followers: Sequence[BaseProcess]) -> None:
    for follower in followers:
        if follower.exitcode is not None:
            raise RuntimeError(
                f"tensor-parallel {follower.name} (pid {follower.pid}) exited with code {follower.exitcode} "
                "before it joined rank 0: see its error above"
            )


def _follow(config: EngineConfig, rank: int, address: str, parent_pid: int) -> None:
    """A follower rank's process: join rank 0, load this rank's slice, run every step rank 0 sends."""
    exit_with_parent(parent_pid)
    host, port = address.rsplit(":", 1)
    size, timeout = config.tensor_parallel_size, timedelta(seconds=config.group.join_timeout_s)
    store = connect_store(host, int(port), size, timeout)
    announce(store, rank)
    parallel = join(
        store, rank, size, rank_device(config.device, rank % config.ranks_per_pod), config.group.gloo_host
    )
    TorchRunner(config, (), parallel=parallel).follow()


class TorchRunner:
    """The ``Runner`` of a real model: it owns the weights, the KV pool and the sampler."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Collection[int],
        backend: AttentionBackend | None = None,
        *,
        parallel: TensorParallel = SINGLE,
        followers: Sequence[BaseProcess] = (),
    ) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.parallel = parallel
        self.followers = list(followers)
        self.is_broken = False
        self.is_closed = False
        self.device = (
            rank_device(config.device, parallel.rank % config.ranks_per_pod)
            if parallel.size > 1
            else config.device
        )
        self.args = read_model_args(config.model_path)
        self.dtype = config.resolve_dtype(self.args.checkpoint_dtype)
        self.backend = backend or TorchAttentionBackend()
        self.model = self._load(config.model_path, self.args)
        self.draft = self._load_draft()
        geometry = self._measure_geometry()
        self.kv_cache = torch.zeros(geometry.shape, dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.measured = Measured()
        spec = config.engine.kv_cache
        self.tiers = TierStore.create(
            self.kv_cache,
            tier_blocks(spec.host_memory_gib, geometry.bytes_per_block),
            spec.disk,
            self.measured,
        )
        self.geometry = dataclasses.replace(
            geometry, num_host_blocks=self.tiers.num_host_blocks, num_disk_blocks=self.tiers.num_disk_blocks
        )
        self.lora = self._lora_model()
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed), eos_token_ids)
        self.masks = MaskFiller()
        self.draft_kv_cache: torch.Tensor | None = None
        self.proposer = self._build_proposer()

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def _load(self, path: Path, args: ModelArgs) -> LlamaForCausalLM:
        return load_model(
            path,
            args,
            self.backend,
            max_positions=self.config.max_model_len,
            dtype=self.dtype,
            device=self.device,
            parallel=self.parallel,
        )

    def _load_draft(self) -> tuple[LlamaForCausalLM, ModelArgs] | None:
        """The draft model of ``speculative.method: draft``; its vocabulary must be the target's (the
        config refuses a draft with tensor parallelism or KV tiers)."""
        path = self.config.draft_model_path
        if path is None:
            return None
        args = read_model_args(path)
        if args.vocab_size != self.args.vocab_size:
            raise ValueError(
                f"the draft model {path} has a vocabulary of {args.vocab_size} tokens, the model "
                f"{self.args.vocab_size}: speculative.draftModel must share the model's tokenizer"
            )
        return self._load(path, args), args

    def _build_proposer(self) -> Proposer | None:
        spec = self.config.engine.speculative
        if spec is None:
            return None
        ngram = NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
        if self.draft is None:
            return ngram
        model, args = self.draft
        shape = (args.num_layers, *self.geometry.shape[1:4], args.num_kv_heads, args.head_dim)
        self.draft_kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        model.bind_kv_cache(self.draft_kv_cache)
        return DraftModelProposer(
            model, block_size=self.config.block_size, window_sizes=args.window_sizes, device=self.device,
            sampler=self.sampler, adapter_proposer=ngram,
        )  # fmt: skip

    def _lora_model(self) -> LoraModel | None:
        if self.config.max_loras == 0:
            return None
        return LoraModel(
            self.model,
            num_slots=self.config.max_loras,
            max_rank=self.config.engine.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )

    def load_lora(self, name: str, path: Path) -> None:
        if self.lora is None:
            raise ValueError("this worker runs no LoRA adapters: start it with engine.maxLoras above 0")
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        if self.lora is not None:
            self.lora.unload(name)

    @property
    def pooling(self) -> PoolingConfig | None:
        return None

    def _kv_budget_bytes(self) -> int:
        spec = self.config.engine.kv_cache
        if spec.memory_gib is not None:
            return int(spec.memory_gib * 2**30)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return max(0, int(free - total * (1.0 - spec.memory_utilization)))
        return int(DEFAULT_CPU_KV_GIB * 2**30)

    def _measure_geometry(self) -> CacheGeometry:
        """The pool of this rank's KV heads; under tensor parallelism, as many blocks as the rank with
        the least room holds (the scheduler's block ids are every rank's)."""
        block_size = self.config.block_size
        num_kv_heads = local_heads(self.args, self.parallel)[3]
        per_block = bytes_per_block(
            dataclasses.replace(self.args, num_kv_heads=num_kv_heads), block_size, self.dtype
        )
        draft_per_block = 0 if self.draft is None else bytes_per_block(self.draft[1], block_size, self.dtype)
        num_blocks = self.parallel.all_reduce_min(self._kv_budget_bytes() // (per_block + draft_per_block))
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no {per_block + draft_per_block}-byte block: raise "
                "engine.kvCache.memoryGiB or memoryUtilization, or lower blockSize"
            )
        return CacheGeometry(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=self.args.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=self.args.head_dim,
            dtype=self.dtype,
            bytes_per_block=per_block,
        )

    def check_health(self) -> None:
        """Raise if the device can run no more work: a CUDA error stays with the process for good, and
        a failed step under tensor parallelism may have left the other ranks inside a collective."""
        if self.is_broken:
            raise RuntimeError("a tensor-parallel step failed, and the other ranks cannot be resynchronized")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """The plan's tier moves and block copies, the proposals, one forward over every chunk and
        proposed token, then a token per sampled chunk or the verified tokens of a proposal (the moves
        are queued first: on CUDA they run while the inputs are prepared); under tensor parallelism
        the same step goes to every rank first (``follow``)."""
        self.move_blocks(plan.kv_moves)
        started = time.perf_counter()
        if self.draft_kv_cache is not None and plan.block_copies:
            sources, targets = zip(*plan.block_copies, strict=True)
            self.draft_kv_cache[:, :, list(targets)] = self.draft_kv_cache[:, :, list(sources)]
        proposals = self.proposer.propose(plan) if self.proposer is not None else {}
        sampled = [chunk for chunk in plan.chunks if chunk.is_sampled]
        plain = [chunk.seq for chunk in sampled if chunk not in proposals]
        masks = self.masks.start([seq.grammar for seq in plain])  # computed while the forward runs
        proposed = {chunk: proposal.token_ids for chunk, proposal in proposals.items()}
        device = self.device if self.parallel.size == 1 else _CPU
        inputs = prepare_inputs(plan.chunks, self.config.block_size, device, self.args.window_sizes, proposed)
        if self.parallel.size == 1:
            hidden = self._forward(plan.block_copies, inputs)
        else:
            try:
                self.parallel.broadcast_object((plan.block_copies, inputs))
                inputs = inputs.to(self.device)
                hidden = self._forward(plan.block_copies, inputs)
            except BaseException:
                self.is_broken = True
                raise
        logits = self.model.compute_logits(hidden[inputs.sample_index])
        if proposals:
            results = self._sample_and_verify(logits, sampled, proposals, masks)
        else:
            results = self.sampler.sample(logits, plain, masks)
        # Sampling read the logits back: the step is done.
        self.measured.add_step(plan.num_tokens, time.perf_counter() - started)
        return results

    def _sample_and_verify(
        self,
        logits: torch.Tensor,
        sampled: list[ScheduledChunk],
        proposals: dict[ScheduledChunk, Proposal],
        masks: PendingMasks | None,
    ) -> list[StepResult]:
        """Plain chunks sampled as one batch (with their grammar masks), each proposal verified on its
        own rows; chunk order. A grammar-constrained sequence never carries a proposal."""
        starts, row = [], 0
        for chunk in sampled:
            starts.append(row)
            row += 1 + (len(proposals[chunk].token_ids) if chunk in proposals else 0)
        plain = [index for index, chunk in enumerate(sampled) if chunk not in proposals]
        plain_results = self.sampler.sample(
            logits[[starts[i] for i in plain]], [sampled[i].seq for i in plain], masks
        )
        results = dict(zip(plain, plain_results, strict=True))
        for index, chunk in enumerate(sampled):
            if chunk in proposals:
                proposal = proposals[chunk]
                rows = logits[starts[index] : starts[index] + len(proposal.token_ids) + 1]
                results[index] = self.sampler.verify(rows, chunk.seq, proposal)
        return [results[index] for index in range(len(sampled))]

    def move_blocks(self, moves: list[KVMove]) -> None:
        self.tiers.apply(moves)

    def _forward(self, block_copies: list[tuple[int, int]], inputs: StepInputs) -> torch.Tensor:
        if block_copies:
            sources, targets = zip(*block_copies, strict=True)
            self.kv_cache[:, :, list(targets)] = self.kv_cache[:, :, list(sources)]
        if self.lora is not None:
            self.lora.prepare(inputs.lora_rows)
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata)  # type: ignore[no-any-return]

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower rank: run each step rank 0 broadcasts, until it sends ``None`` (``close``)."""
        while (step := self.parallel.broadcast_object(None)) is not None:
            block_copies, inputs = step
            self._forward(block_copies, inputs.to(self.device))

    def close(self) -> None:
        """Rank 0: stop the follower ranks, local and remote (each process ends after the last step
        it is sent); the local processes that do not end within seconds are killed. The disk tier's
        writer ends too."""
        self.tiers.close()
        if self.parallel.rank == 0 and self.parallel.size > 1 and not (self.is_broken or self.is_closed):
            self.is_closed = True  # a second close sends nothing
            self.parallel.broadcast_object(None)
        for follower in self.followers:
            follower.join(timeout=10)
            if follower.is_alive():
                follower.kill()
        self.followers = []

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv_cache[:, :, block_ids].cpu()

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        kept = [(row, block_id) for row, block_id in enumerate(block_ids) if block_id is not None]
        if not kept:
            return
        rows, targets = [row for row, _ in kept], [block_id for _, block_id in kept]
        # One indexed copy: a copy per block is ~20x slower.
        source = kv if len(rows) == len(block_ids) else kv[:, :, rows]
        self.kv_cache[:, :, targets] = source.to(self.kv_cache.device)
