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
import time
from collections.abc import Collection
from pathlib import Path

import torch

from herd.api.prompt import PromptRenderer
from herd.worker.cache_geometry import CacheGeometry, bytes_per_block, tier_blocks
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.grammar import MaskFiller
from herd.worker.input_batch import prepare_inputs
from herd.worker.kv_store import TierStore
from herd.worker.kv_tiers import KVMove
from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.torch_attention import TorchAttentionBackend
from herd.worker.loader import load_model, read_model_args
from herd.worker.lora_model import LoraModel
from herd.worker.runner import PREFILL_MIN_TOKENS, Measured, StepResult
from herd.worker.sampler import Sampler
from herd.worker.scheduler import SchedulerOutput

__all__ = ["DEFAULT_CPU_KV_GIB", "TorchRunner", "torch_engine"]

DEFAULT_CPU_KV_GIB = 1.0


def torch_engine(config: EngineConfig) -> LLMEngine:
    """herd's engine on the model at ``config.model_path``: its renderer, weights and KV pool."""
    renderer = PromptRenderer.from_pretrained(config.model_path)
    return LLMEngine(config, TorchRunner(config, renderer.eos_token_ids), renderer)


class TorchRunner:
    """The ``Runner`` of a real model: it owns the weights, the KV pool and the sampler."""

    def __init__(
        self, config: EngineConfig, eos_token_ids: Collection[int], backend: AttentionBackend | None = None
    ) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.device = config.device
        self.args = read_model_args(config.model_path)
        self.dtype = config.resolve_dtype(self.args.checkpoint_dtype)
        self.model = load_model(
            config.model_path,
            self.args,
            backend or TorchAttentionBackend(),
            max_positions=config.max_model_len,
            dtype=self.dtype,
            device=self.device,
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

    def _kv_budget_bytes(self) -> int:
        spec = self.config.engine.kv_cache
        if spec.memory_gib is not None:
            return int(spec.memory_gib * 2**30)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return max(0, int(free - total * (1.0 - spec.memory_utilization)))
        return int(DEFAULT_CPU_KV_GIB * 2**30)

    def _measure_geometry(self) -> CacheGeometry:
        block_size = self.config.block_size
        per_block = bytes_per_block(self.args, block_size, self.dtype)
        num_blocks = self._kv_budget_bytes() // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no {per_block}-byte block: raise engine.kvCache.memoryGiB "
                "or memoryUtilization, or lower blockSize"
            )
        return CacheGeometry(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=self.args.num_layers,
            num_kv_heads=self.args.num_kv_heads,
            head_dim=self.args.head_dim,
            dtype=self.dtype,
            bytes_per_block=per_block,
        )

    def check_health(self) -> None:
        """Raise if the device can run no more work: a CUDA error stays with the process for good."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """The plan's tier moves and block copies, one forward over every chunk, then a token per
        sampled chunk (the moves are queued first: on CUDA they run while the inputs are prepared)."""
        self.move_blocks(plan.kv_moves)
        if plan.block_copies:
            sources, targets = zip(*plan.block_copies, strict=True)
            self.kv_cache[:, :, list(targets)] = self.kv_cache[:, :, list(sources)]
        started = time.perf_counter()
        sampled = [chunk.seq for chunk in plan.chunks if chunk.is_sampled]
        masks = self.masks.start([seq.grammar for seq in sampled])  # computed while the forward runs
        inputs = prepare_inputs(plan.chunks, self.config.block_size, self.device, self.args.window_sizes)
        if self.lora is not None:
            self.lora.prepare([(chunk.seq.lora_name, chunk.num_tokens) for chunk in inputs.row_chunks])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = self.model.compute_logits(hidden[inputs.sample_index])
        results = self.sampler.sample(logits, sampled, masks)
        if plan.num_tokens >= PREFILL_MIN_TOKENS:  # sampling read the logits back: the step is done
            self.measured.prefill.add(plan.num_tokens, time.perf_counter() - started)
        return results

    def move_blocks(self, moves: list[KVMove]) -> None:
        self.tiers.apply(moves)

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
