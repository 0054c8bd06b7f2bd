"""The torch runner: loads the model, allocates the KV pool from a memory budget, runs and samples plans.

The pool's size is measured here and returned as a ``CacheGeometry`` (the block manager is built
from it): an explicit ``kvCache.memoryGiB``, else on CUDA the free memory above the share
``1 - memoryUtilization`` of the device left for activations, else 1 GiB on CPU. A step copies
the plan's blocks, runs one batched forward over every chunk, and samples the rows whose chunk
reached its sequence's end (``herd.worker.sampler``). ``torch_engine`` builds herd's engine on it.

With ``engine.speculative`` the runner also owns a proposer (``herd.worker.speculative``): n-gram
lookup, or a draft model whose own KV pool, sized block for block with the target's, shares the
memory budget. The proposals enter the same forward after their chunks' tokens, and the sampler
verifies them.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from herd.api.prompt import PromptRenderer
from herd.worker.cache_geometry import CacheGeometry, bytes_per_block
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.input_batch import prepare_inputs
from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.torch_attention import TorchAttentionBackend
from herd.worker.loader import load_model, read_model_args
from herd.worker.models import ModelArgs
from herd.worker.models.llama import LlamaForCausalLM
from herd.worker.runner import StepResult
from herd.worker.sampler import Sampler
from herd.worker.scheduler import ScheduledChunk, SchedulerOutput
from herd.worker.speculative.draft_model import DraftModelProposer
from herd.worker.speculative.proposer import NgramProposer, Proposal, Proposer

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
        self.backend = backend or TorchAttentionBackend()
        self.args = read_model_args(config.model_path)
        self.dtype = config.resolve_dtype(self.args.checkpoint_dtype)
        self.model = self._load(config.model_path, self.args)
        self.draft = self._load_draft()
        self.geometry = self._measure_geometry()
        self.kv_cache = torch.zeros(self.geometry.shape, dtype=self.dtype, device=self.device)
        self.model.bind_kv_cache(self.kv_cache)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed), eos_token_ids)
        self.draft_kv_cache: torch.Tensor | None = None
        self.proposer = self._build_proposer()

    def _load(self, path: Path, args: ModelArgs) -> LlamaForCausalLM:
        return load_model(
            path,
            args,
            self.backend,
            max_positions=self.config.max_model_len,
            dtype=self.dtype,
            device=self.device,
        )

    def _load_draft(self) -> tuple[LlamaForCausalLM, ModelArgs] | None:
        """The draft model of ``speculative.method: draft``; its vocabulary must be the target's."""
        spec = self.config.engine.speculative
        if spec is None or spec.draft_model is None:
            return None
        path = self.config.draft_model_path
        assert path is not None  # the config resolves draftModel whenever it is set
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
        if self.draft is None:
            return NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
        model, args = self.draft
        shape = (args.num_layers, *self.geometry.shape[1:4], args.num_kv_heads, args.head_dim)
        self.draft_kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        model.bind_kv_cache(self.draft_kv_cache)
        return DraftModelProposer(
            model, block_size=self.config.block_size, window_sizes=args.window_sizes, device=self.device,
            sampler=self.sampler,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

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
        draft_per_block = 0 if self.draft is None else bytes_per_block(self.draft[1], block_size, self.dtype)
        num_blocks = self._kv_budget_bytes() // (per_block + draft_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no {per_block + draft_per_block}-byte block: raise "
                "engine.kvCache.memoryGiB or memoryUtilization, or lower blockSize"
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
        """The plan's block copies, the proposals, one forward over every chunk and proposed token,
        then a token per sampled chunk (or the verified tokens of a proposal)."""
        if plan.block_copies:
            sources, targets = zip(*plan.block_copies, strict=True)
            self.kv_cache[:, :, list(targets)] = self.kv_cache[:, :, list(sources)]
            if self.draft_kv_cache is not None:
                self.draft_kv_cache[:, :, list(targets)] = self.draft_kv_cache[:, :, list(sources)]
        proposals = self.proposer.propose(plan) if self.proposer is not None else {}
        inputs = prepare_inputs(
            plan.chunks,
            self.config.block_size,
            self.device,
            self.args.window_sizes,
            {chunk: proposal.token_ids for chunk, proposal in proposals.items()},
        )
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = self.model.compute_logits(hidden[inputs.sample_index])
        sampled = [chunk for chunk in plan.chunks if chunk.is_sampled]
        if not proposals:
            return self.sampler.sample(logits, [chunk.seq for chunk in sampled])
        return self._sample_and_verify(logits, sampled, proposals)

    def _sample_and_verify(
        self, logits: torch.Tensor, sampled: list[ScheduledChunk], proposals: dict[ScheduledChunk, Proposal]
    ) -> list[StepResult]:
        """Plain chunks sampled as one batch, each proposal verified on its own rows; chunk order."""
        starts, row = [], 0
        for chunk in sampled:
            starts.append(row)
            row += 1 + (len(proposals[chunk].token_ids) if chunk in proposals else 0)
        plain = [index for index, chunk in enumerate(sampled) if chunk not in proposals]
        plain_results = self.sampler.sample(
            logits[[starts[i] for i in plain]], [sampled[i].seq for i in plain]
        )
        results = dict(zip(plain, plain_results, strict=True))
        for index, chunk in enumerate(sampled):
            if chunk in proposals:
                proposal = proposals[chunk]
                rows = logits[starts[index] : starts[index] + len(proposal.token_ids) + 1]
                results[index] = self.sampler.verify(rows, chunk.seq, proposal)
        return [results[index] for index in range(len(sampled))]

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
