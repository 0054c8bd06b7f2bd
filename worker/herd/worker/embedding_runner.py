"""The runner of an embedding model: an encoder forward over whole sequences, pooled per sequence.

The scheduler plans an embedding request like any prompt, but never in chunks (the geometry says
``holds_kv`` False): bidirectional attention needs the whole sequence in one forward, and nothing
is cached between steps. A step runs every planned sequence through the encoder at once and
returns one ``PooledOutput`` each. The "blocks" of its geometry hold no memory: they only count a
step's tokens, so the block manager admits about ``maxBatchTokens`` tokens a step.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from herd.worker.cache_geometry import CacheGeometry
from herd.worker.config import EngineConfig
from herd.worker.kv_tiers import KVMove
from herd.worker.loader import load_encoder, read_encoder_args
from herd.worker.models.bert import EncoderBatch
from herd.worker.pooling import pool, read_pooling
from herd.worker.runner import PREFILL_MIN_TOKENS, Measured, PooledOutput, StepResult
from herd.worker.scheduler import SchedulerOutput

__all__ = ["EmbeddingRunner"]


class EmbeddingRunner:
    """The ``Runner`` of an encoder: it owns the weights and pools; it has no KV pool."""

    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.device = config.device
        self.args = read_encoder_args(config.model_path)
        dtype = config.resolve_dtype(self.args.checkpoint_dtype)
        self.model = load_encoder(config.model_path, self.args, dtype=dtype, device=self.device)
        max_len = min(self.args.max_position_embeddings, config.max_model_len)
        pooling = read_pooling(config.model_path, self.args.hidden_size)
        self.pooling = replace(pooling, max_len=min(pooling.max_len or max_len, max_len))
        block_size = config.block_size
        step_tokens = max(config.engine.max_batch_tokens, max_len)
        self.geometry = CacheGeometry(
            # A step's tokens, each sequence's last block partly filled: no memory behind them.
            num_blocks=-(-step_tokens // block_size) + config.engine.max_batch_size,
            block_size=block_size,
            num_layers=self.args.num_layers,
            num_kv_heads=self.args.num_heads,
            head_dim=self.args.head_dim,
            dtype=dtype,
            bytes_per_block=0,
            holds_kv=False,
        )
        self.measured = Measured()
        """Only the prefill rate: an encoder has no KV tiers to restore from."""

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def check_health(self) -> None:
        """Raise if the device can run no more work: a CUDA error stays with the process for good."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """Every planned sequence through the encoder in one forward; one pooled vector each."""
        if any(chunk.start != 0 or not chunk.is_sampled for chunk in plan.chunks):
            raise RuntimeError("an encoder runs whole sequences, but the plan holds a partial chunk")
        started = time.perf_counter()
        seqs = [chunk.seq for chunk in plan.chunks]
        lengths = [seq.num_tokens for seq in seqs]
        input_ids = torch.tensor(
            [token for seq in seqs for token in seq.prompt_token_ids], device=self.device
        )
        positions = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
        hidden = self.model(input_ids, positions, EncoderBatch.of(lengths, self.device))
        vectors = pool(hidden, lengths, self.pooling.mode, normalize=self.pooling.normalize)
        pooled: list[StepResult] = [PooledOutput(vector) for vector in vectors.cpu().tolist()]
        if plan.num_tokens >= PREFILL_MIN_TOKENS:
            self.measured.prefill.add(plan.num_tokens, time.perf_counter() - started)
        return pooled

    def move_blocks(self, moves: list[KVMove]) -> None:
        if moves:  # its block manager has no tiers, so it plans none
            raise ValueError("an embedding model keeps no KV blocks to move between tiers")

    def load_lora(self, name: str, path: Path) -> None:
        raise ValueError("an embedding model runs no LoRA adapters: serve adapters on a generation model")

    def unload_lora(self, name: str) -> None:
        raise ValueError(f"an embedding model has no LoRA adapter {name!r} to unload")

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        raise ValueError("an embedding model keeps no KV blocks to export")

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        raise ValueError("an embedding model keeps no KV blocks to import")
