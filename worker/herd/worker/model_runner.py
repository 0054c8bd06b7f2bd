"""The torch runner: loads the model, allocates the KV pool from a memory budget, runs and samples plans.

The pool's size is measured here and returned as a ``CacheGeometry`` (the block manager is built
from it): an explicit ``kvCache.memoryGiB``, else on CUDA the free memory above the share
``1 - memoryUtilization`` of the device left for activations, else 1 GiB on CPU. A step copies
the plan's blocks, starts the grammar masks of its constrained sequences on a side thread, runs one
batched forward over every chunk, and samples the rows whose chunk reached its sequence's end
(``herd.worker.sampler``). The tiers below the pool (``kvCache.hostMemoryGiB``, ``kvCache.disk``) are
``herd.worker.kv_store``'s; a step makes its plan's moves between them first. ``torch_engine`` builds
herd's engine on it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Collection, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from herd.api.prompt import PromptRenderer
from herd.worker.cache_geometry import CacheGeometry, bytes_per_block, tier_blocks
from herd.worker.config import EngineConfig
from herd.worker.embedding_runner import EmbeddingRunner
from herd.worker.engine import LLMEngine
from herd.worker.grammar import MaskFiller
from herd.worker.input_batch import StepInputs, prepare_inputs
from herd.worker.kv_store import TierStore
from herd.worker.kv_tiers import KVMove
from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.torch_attention import TorchAttentionBackend
from herd.worker.loader import is_encoder, load_model, read_model_args
from herd.worker.lora_model import LoraModel
from herd.worker.models import UnsupportedModelError
from herd.worker.models.llama import SINGLE, local_heads
from herd.worker.parallel import TensorParallel, connect_store, die_with_parent, join, listen, rank_device
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import PREFILL_MIN_TOKENS, Measured, StepResult
from herd.worker.sampler import Sampler
from herd.worker.scheduler import SchedulerOutput

__all__ = ["DEFAULT_CPU_KV_GIB", "TorchRunner", "torch_engine"]

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
    """Rank 0's runner, with a process per other rank started beside it (``_follow``)."""
    size = config.tensor_parallel_size
    store = listen(size)
    address = f"{LOOPBACK}:{store.port}"
    context = multiprocessing.get_context("spawn")  # a fork of a process holding torch's threads hangs
    followers = [
        context.Process(target=_follow, args=(config, rank, address), name=f"herd-rank-{rank}", daemon=True)
        for rank in range(1, size)
    ]
    for follower in followers:
        follower.start()
    try:
        parallel = join(store, 0, size, rank_device(config.device, 0))
        return TorchRunner(config, eos_token_ids, parallel=parallel, followers=followers)
    except BaseException:
        for follower in followers:
            follower.kill()
        raise


def _follow(config: EngineConfig, rank: int, address: str) -> None:
    """A follower rank's process: join rank 0, load this rank's slice, run every step rank 0 sends."""
    die_with_parent()
    host, port = address.rsplit(":", 1)
    store = connect_store(host, int(port), config.tensor_parallel_size)
    parallel = join(store, rank, config.tensor_parallel_size, rank_device(config.device, rank))
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
        self.device = rank_device(config.device, parallel.rank) if parallel.size > 1 else config.device
        self.args = read_model_args(config.model_path)
        self.dtype = config.resolve_dtype(self.args.checkpoint_dtype)
        self.model = load_model(
            config.model_path,
            self.args,
            backend or TorchAttentionBackend(),
            max_positions=config.max_model_len,
            dtype=self.dtype,
            device=self.device,
            parallel=parallel,
        )
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

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

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
        num_blocks = self.parallel.all_reduce_min(self._kv_budget_bytes() // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no {per_block}-byte block: raise engine.kvCache.memoryGiB "
                "or memoryUtilization, or lower blockSize"
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
        """The plan's tier moves and block copies, one forward over every chunk, then a token per
        sampled chunk (the moves are queued first: on CUDA they run while the inputs are prepared);
        under tensor parallelism the same step goes to every rank first (``follow``)."""
        self.move_blocks(plan.kv_moves)
        started = time.perf_counter()
        sampled = [chunk.seq for chunk in plan.chunks if chunk.is_sampled]
        masks = self.masks.start([seq.grammar for seq in sampled])  # computed while the forward runs
        if self.parallel.size == 1:
            inputs = prepare_inputs(plan.chunks, self.config.block_size, self.device, self.args.window_sizes)
            hidden = self._forward(plan.block_copies, inputs)
        else:
            inputs = prepare_inputs(plan.chunks, self.config.block_size, _CPU, self.args.window_sizes)
            try:
                self.parallel.broadcast_object((plan.block_copies, inputs))
                inputs = inputs.to(self.device)
                hidden = self._forward(plan.block_copies, inputs)
            except BaseException:
                self.is_broken = True
                raise
        logits = self.model.compute_logits(hidden[inputs.sample_index])
        results = self.sampler.sample(logits, sampled, masks)
        if plan.num_tokens >= PREFILL_MIN_TOKENS:  # sampling read the logits back: the step is done
            self.measured.prefill.add(plan.num_tokens, time.perf_counter() - started)
        return results

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
        """Rank 0: stop the follower ranks (each process ends after its last step)."""
        if self.followers and not self.is_broken:
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
