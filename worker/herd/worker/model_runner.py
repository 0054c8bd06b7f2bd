"""Loads the model, allocates the KV pool from a memory budget, and runs scheduler decisions.

The pool's size is measured here and returned as a ``CacheGeometry`` (the block manager is built
from it): an explicit ``kvCache.memoryGiB``, else on CUDA the free memory above the share
``1 - memoryUtilization`` of the device left for activations, else 1 GiB on CPU.
"""

from __future__ import annotations

import torch

from herd.worker.cache_geometry import CacheGeometry, bytes_per_block
from herd.worker.config import EngineConfig
from herd.worker.input_batch import prepare_inputs
from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.torch_attention import TorchAttentionBackend
from herd.worker.loader import load_model, read_model_args
from herd.worker.scheduler import ScheduledChunk

__all__ = ["DEFAULT_CPU_KV_GIB", "ModelRunner"]

DEFAULT_CPU_KV_GIB = 1.0


class ModelRunner:
    """Owns the weights and the KV pool; ``execute`` runs one step and returns the sampled rows' logits."""

    def __init__(self, config: EngineConfig, backend: AttentionBackend | None = None) -> None:
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
        self.geometry = self._measure_geometry()
        self.kv_cache = torch.zeros(self.geometry.shape, dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_cache)

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

    def check_device(self) -> None:
        """Raise if the device can run no more work: a CUDA error stays with the process for good."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One forward over every chunk; float32 logits ``[num_sampled, vocab]`` in chunk order."""
        inputs = prepare_inputs(chunks, self.config.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model.compute_logits(hidden[inputs.sample_index])
