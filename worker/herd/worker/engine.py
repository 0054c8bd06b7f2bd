"""LLMEngine: the synchronous core of a herd worker.

A step is three calls and touches no tensor: the scheduler plans which tokens of which sequences
run (decodes first, then new or partly prefilled prompts, under the token budget, preempting on a
full KV pool); the runner (``herd.worker.runner``, given to the engine, never built by it) executes
the whole plan and returns one sampled token for each sequence whose chunk reached its last token;
the scheduler advances the computed counts (it put the step's full blocks in the prefix cache
when it planned them, so that requests of the same step share them).
Then each sampled sequence is checked for stop tokens, stop strings, ``max_tokens`` and
``max_model_len``, and finished ones free their blocks at once. ``step`` returns a
``RequestOutput`` for every sequence that got a token.

With speculative decoding (``engine.speculative``) the policy (``herd.worker.speculative.policy``)
first chooses how many tokens to propose this step, from the batch and what it measured; the
scheduler reserves that many draft slots per decoding sequence, the runner proposes and verifies
them in its one forward and returns the accepted tokens plus the model's own; each is taken through
the same stop checks in order (a stop drops the rest), and the scheduler releases the slots of the
rejected ones.

Faults are data, not exceptions unwinding through the loop. One request's fault (its logit edits,
its draw, its logprobs: returned by the runner in its token's place; its stop checks or
detokenizer) ends that request with an error output and frees its blocks; the others go on. A
fault of ``execute`` itself cannot be pinned to a request, so every request of the batch ends with
an error, and the engine checks that it can go on (the runner is healthy, every KV block is held by
a live sequence or a lease, or is free); only when that check fails does ``step`` raise
(``EngineResetError``), and the worker must restart.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from herd.api.kv_hash import BlockHash, root_hash
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, WorkerInfo
from herd.api.resume import RESUME_FIELD
from herd.worker.block_manager import BlockManager, HeldRun
from herd.worker.config import EngineConfig
from herd.worker.detokenizer import IncrementalDetokenizer
from herd.worker.grammar import GrammarError
from herd.worker.kv_tiers import KVTierError
from herd.worker.outputs import FinishReason, RequestOutput
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import PooledOutput, Runner, SampledToken, SpeculatedTokens, StepResult
from herd.worker.sampling_params import InvalidParamError, SamplingParams, check_token_ids
from herd.worker.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from herd.worker.sequence import Sequence
from herd.worker.speculative.policy import Choice, SpeculationPolicy
from herd.worker.stats import EngineStats

if TYPE_CHECKING:
    import torch

__all__ = ["EngineResetError", "LLMEngine", "PromptTooLongError", "QueueFullError", "UnknownLoraError"]

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue holds ``engine.maxQueueLen`` requests; retry later (HTTP 429)."""


class PromptTooLongError(ValueError):
    """Prompt plus ``max_tokens`` exceed ``engine.maxModelLen`` (HTTP 400)."""


class UnknownLoraError(LookupError):
    """The request names a LoRA adapter this engine has not loaded (HTTP 404)."""


class EngineResetError(RuntimeError):
    """After a failed batch the engine could not prove its state sound; the process must restart."""


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer


class LLMEngine:
    """Continuous-batching inference over a paged, prefix-cached KV pool; not thread-safe.

    ``runner`` computes the steps (``herd.worker.model_runner.torch_engine`` builds an engine on the
    torch runner); ``renderer`` gives the stop tokens and the detokenizer; ``clock`` times the steps
    for the speculation policy (a simulation passes its virtual clock).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        renderer: PromptRenderer,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.renderer = renderer
        self.runner = runner
        geometry = runner.geometry
        self.block_manager = BlockManager(
            geometry.num_blocks,
            geometry.block_size,
            enable_prefix_caching=config.engine.kv_cache.prefix_caching and geometry.holds_kv,
            num_host_blocks=geometry.num_host_blocks,
            num_disk_blocks=geometry.num_disk_blocks,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_tokens=config.engine.max_batch_tokens,
            max_batch_size=config.engine.max_batch_size,
            max_model_len=config.max_model_len,
            max_loras=config.max_loras,
            is_chunked=geometry.holds_kv,
        )
        speculative = config.engine.speculative
        self.speculation = (
            None
            if speculative is None
            else SpeculationPolicy(
                speculative.num_tokens,
                adaptive=speculative.adaptive,
                draft_passes=speculative.method == "draft",
            )
        )
        self.clock = clock
        self.stats = EngineStats(
            kv_tiers=self.block_manager.counters,
            spec_accepted_per_pos=[0] * (speculative.num_tokens if speculative else 0),
        )
        self._count_tier_blocks()
        self.vocab_size = runner.vocab_size
        self.pooling = runner.pooling
        self.max_model_len = config.max_model_len
        if self.pooling is not None and self.pooling.max_len is not None:
            self.max_model_len = min(self.max_model_len, self.pooling.max_len)
        self.info = WorkerInfo(
            model=config.served_name,
            role=config.role,
            block_size=geometry.block_size,
            max_model_len=self.max_model_len,
            epoch=uuid.uuid4().hex,
            dtype=str(geometry.dtype).removeprefix("torch."),
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            vocab_size=self.vocab_size,
            **_embedding_info(self.pooling),
        )
        self._requests: dict[str, _Request] = {}
        self._held: dict[str, list[int]] = {}
        self.lora_adapters: dict[str, Path] = {}
        """The LoRA adapters loaded, by name: the folder each was read from."""
        for name, path in config.lora_modules.items():
            self.load_lora(name, path)
        log.info(
            "engine ready",
            extra={
                "model": config.served_name,
                "num_kv_blocks": geometry.num_blocks,
                "num_host_blocks": geometry.num_host_blocks,
                "num_disk_blocks": geometry.num_disk_blocks,
            },
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        first_token_id: int | None = None,
        resumed_token_ids: SequenceOf[int] = (),
        lora_name: str | None = None,
    ) -> RequestOutput | None:
        """Queue a request; raises ``QueueFullError``, ``PromptTooLongError``, ``UnknownLoraError``
        or ``ValueError``. ``lora_name`` runs it with that loaded adapter (``None``: the base model).

        ``first_token_id`` is a first output token sampled elsewhere (a prefill worker, with this
        request's settings): it is appended now, through the same stop checks and detokenizer as a
        sampled token, and returned as the request's first output; the steps then compute the
        prompt's uncached tail with it and sample the second token. Without it, returns None.

        ``resumed_token_ids`` are output tokens another worker already streamed (``herd.api.resume``):
        they are appended as if sampled here (grammar, detokenizer, budgets; the sampler advances a
        seeded generator over them) and returned as one output marked ``is_resumed``, whose text the
        client already has; the steps then compute prompt and tokens and sample the next one.
        """
        self._check_request(request_id, prompt_token_ids, params)
        if lora_name is not None and lora_name not in self.lora_adapters:
            raise UnknownLoraError(self._unknown_lora(lora_name))
        if first_token_id is not None:
            check_token_ids([first_token_id], self.vocab_size, param="kv_transfer_params")
        if resumed_token_ids:
            check_token_ids(resumed_token_ids, self.vocab_size, param=RESUME_FIELD)
            if params.seed is not None and self.speculation is not None:
                raise InvalidParamError(
                    RESUME_FIELD,
                    "a seeded stream cannot resume on a worker that speculates (its draws differ from "
                    "one token at a time): the stream ends here; send it again, or serve it without "
                    "engine.speculative",
                )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            root_hash=root_hash(self.config.served_name, cache_salt, lora_name),
            lora_name=lora_name,
            grammar=None if params.grammar is None else params.grammar.matcher(),
        )
        if first_token_id is not None and seq.grammar is not None and not seq.grammar.accepts(first_token_id):
            log.warning(
                "the handed first token breaks the grammar; sampling it here",
                extra={"request_id": request_id},
            )
            first_token_id = None
        detokenizer = IncrementalDetokenizer(self.renderer, prompt_token_ids, params.stop)
        resumed = (
            _resume(seq, detokenizer, resumed_token_ids, self._finish_reason) if resumed_token_ids else None
        )
        self._requests[request_id] = _Request(seq, detokenizer)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(prompt_token_ids)
        if first_token_id is None:
            return resumed
        return self._advance(ScheduledChunk(seq, 0), SampledToken(first_token_id, None))

    def _check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine: use a unique id")
        if not prompt_token_ids:
            raise InvalidParamError("prompt", "the prompt is empty: send at least one token")
        check_token_ids(prompt_token_ids, self.vocab_size, param="prompt")
        params.check_vocab(self.vocab_size)
        if self.pooling is not None:  # an embedding: the prompt alone, no output
            if len(prompt_token_ids) > self.max_model_len:
                raise PromptTooLongError(
                    f"this model embeds at most {self.max_model_len} tokens, but the input has "
                    f"{len(prompt_token_ids)}: shorten it"
                )
            self._check_queue()
            return
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"has {len(prompt_token_ids)} prompt tokens plus max_tokens {params.max_tokens} ({total}): "
                "shorten the prompt or lower max_tokens"
            )
        pool_tokens = self.block_manager.num_total_blocks * self.block_manager.block_size
        if total > pool_tokens:
            raise ValueError(
                f"the request needs {total} tokens of KV cache but the whole pool holds {pool_tokens}: "
                "lower max_tokens or give the engine more KV memory (engine.kvCache)"
            )
        self._check_queue()

    def _check_queue(self) -> None:
        if len(self.scheduler.waiting) >= self.config.engine.max_queue_len:
            raise QueueFullError(
                f"{len(self.scheduler.waiting)} requests are waiting (engine.maxQueueLen): retry later"
            )

    def _unknown_lora(self, name: str) -> str:
        loaded = ", ".join(map(repr, self.lora_adapters)) or "none"
        return f"LoRA adapter {name!r} is not loaded on this worker (loaded: {loaded}); load it first"

    def load_lora(self, name: str, path: Path) -> None:
        """Read the PEFT adapter at ``path`` into host memory as ``name``; raises ``ValueError`` if
        LoRA is off, the name is taken, or the adapter does not fit the model or ``maxLoraRank``.
        Loading the same folder under the same name again does nothing (an orchestrator may ask twice)."""
        if self.lora_adapters.get(name) == path:
            return
        if self.config.max_loras == 0:
            raise ValueError("this worker runs no LoRA adapters: start it with engine.maxLoras above 0")
        if name == self.config.served_name or name in self.lora_adapters:
            raise ValueError(f"the name {name!r} is taken on this worker: unload it first or pick another")
        self.runner.load_lora(name, path)
        self.lora_adapters[name] = path
        log.info("LoRA adapter loaded", extra={"lora_name": name, "path": str(path)})

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` and forget its cached KV blocks; raises ``UnknownLoraError``, or
        ``ValueError`` while requests still run with it."""
        if name not in self.lora_adapters:
            raise UnknownLoraError(self._unknown_lora(name))
        num_using = sum(1 for request in self._requests.values() if request.seq.lora_name == name)
        if num_using:
            raise ValueError(f"LoRA adapter {name!r} serves {num_using} requests: unload it when they finish")
        self.runner.unload_lora(name)
        del self.lora_adapters[name]
        self.block_manager.forget(self.block_manager.lora_blocks(name))
        log.info("LoRA adapter unloaded", extra={"lora_name": name})

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks now; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq)
        self.release_held(request_id)  # the caller may have gone before it saw its held blocks

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        choice = self._speculation_choice()
        decision = self.scheduler.schedule(choice.num_tokens, choice.num_seqs)
        self._count(decision)
        if decision.is_empty:
            return []
        started = self.clock()
        try:
            results = self.runner.execute(decision)  # a sequence's own failure comes back as data
        except KVTierError as error:
            self._drop_tier(decision, error)
            return []
        except Exception as error:
            return self._fail_batch(decision, error)
        seconds = self.clock() - started
        sampled = [chunk for chunk in decision.chunks if chunk.is_sampled]  # before update moves them
        self.scheduler.update(decision)
        if self.speculation is not None:
            self._observe_speculation(decision, sampled, results, seconds)
        return [self._advance(chunk, result) for chunk, result in zip(sampled, results, strict=True)]

    def _speculation_choice(self) -> Choice:
        if self.speculation is None:
            return Choice(0)
        num_decoding = sum(1 for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1)
        return self.speculation.choose(num_decoding)

    def _observe_speculation(
        self,
        decision: SchedulerOutput,
        sampled: list[ScheduledChunk],
        results: list[StepResult],
        seconds: float,
    ) -> None:
        """Feed the policy (acceptance, the step's cost) and count drafts under vLLM's metric names."""
        assert self.speculation is not None
        num_proposed = 0
        longest = 0
        for chunk, result in zip(sampled, results, strict=True):
            if not chunk.num_draft_slots or isinstance(result, Exception):
                continue
            proposed, accepted = (
                (result.num_proposed, result.num_accepted) if isinstance(result, SpeculatedTokens) else (0, 0)
            )
            self.speculation.acceptance.observe(proposed, accepted)
            num_proposed += proposed
            longest = max(longest, proposed)
            self.stats.count_draft(proposed, accepted)
        if all(chunk.num_tokens == 1 for chunk in decision.chunks):
            # Only decode steps: the choice is about them, and a prefill chunk's tokens (compute-bound)
            # cost far more each than a decode's few (bound by reading the weights).
            num_passes = max(0, longest - 1) if self.speculation.draft_passes else 0
            self.speculation.step_cost.observe(decision.num_tokens + num_proposed, num_passes, seconds)

    def _count(self, decision: SchedulerOutput) -> None:
        if decision.kv_moves:
            self._count_tier_blocks()
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(decision.preempted)
        self.stats.prefix_cache_queries += decision.num_cache_queries
        self.stats.prefix_cache_hits += decision.num_cache_hits

    def _count_tier_blocks(self) -> None:
        self.stats.kv_tier_blocks = {
            tier.medium: (tier.num_used, tier.num_slots) for tier in self.block_manager.tiers()
        }

    def _advance(self, chunk: ScheduledChunk, sampled: StepResult) -> RequestOutput:
        """Take the chunk's new tokens; a failure here (or in its sampling) ends its sequence alone."""
        seq = chunk.seq
        if isinstance(sampled, Exception):
            return self._fail_request(seq, sampled, stage="sampling")
        if isinstance(sampled, PooledOutput):
            return self._pooled(seq, sampled)
        tokens = sampled.tokens if isinstance(sampled, SpeculatedTokens) else (sampled,)
        try:
            output = self._append(seq, tokens)
        except Exception as error:
            return self._fail_request(seq, error, stage="stop checks and detokenization")
        if chunk.num_draft_slots and not output.finished:
            self.scheduler.settle_drafts(seq, len(tokens) - 1)
        return output

    def _append(self, seq: Sequence, tokens: tuple[SampledToken, ...]) -> RequestOutput:
        """Append ``tokens`` in order, each through the stop checks; a stop drops the ones after it."""
        request = self._requests[seq.request_id]
        taken: list[SampledToken] = []
        text = ""
        reason: FinishReason | None = None
        for sampled in tokens:
            if seq.grammar is not None:
                seq.grammar.advance(sampled.token_id)
            seq.append_token(sampled.token_id, sampled.logprob)
            self.stats.generation_tokens += 1
            taken.append(sampled)
            reason = self._finish_reason(seq, sampled.token_id)
            may_stop = seq.num_output_tokens >= seq.params.min_tokens
            text += request.detokenizer.add([sampled.token_id], is_last=reason is not None, may_stop=may_stop)
            if request.detokenizer.is_stopped:
                reason = "stop"
            if reason is not None:
                break
        held = None
        if reason is not None:
            seq.finish_reason = reason
            held = self._hold_prompt(seq) if seq.params.hold_prompt_blocks else None
            self.scheduler.finish(seq)
            del self._requests[seq.request_id]
        logprobs = [sampled.logprob for sampled in taken if sampled.logprob is not None]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[sampled.token_id for sampled in taken],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=logprobs or None,
            held_block_ids=held,
        )

    def _pooled(self, seq: Sequence, pooled: PooledOutput) -> RequestOutput:
        """An embedding is done in the step that computed its sequence."""
        seq.finish_reason = "stop"
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=0,
            num_output_tokens=0,
            embedding=pooled.embedding,
        )

    def _fail_request(self, seq: Sequence, error: Exception, *, stage: str) -> RequestOutput:
        if isinstance(error, GrammarError):  # the request's grammar gave out, not the engine
            log.warning(
                "request's grammar failed; the engine goes on",
                extra={"request_id": seq.request_id, "param": error.param, "error": str(error)},
            )
            message = f"{error.param} could not be followed while generating ({error.summary}): simplify it"
            return self._end_with_error(seq, message, param=error.param)
        log.error(
            "request failed; the engine goes on",
            extra={"request_id": seq.request_id, "stage": stage},
            exc_info=error,
        )
        return self._end_with_error(
            seq, f"the engine failed this request during {stage}: {type(error).__name__}: {error}"
        )

    def _fail_batch(self, decision: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The batched forward failed: no one request is to blame, so the whole batch fails."""
        seqs = [chunk.seq for chunk in decision.chunks]
        log.error(
            "batch failed; its requests fail and the engine resets",
            extra={"request_ids": [seq.request_id for seq in seqs]},
            exc_info=error,
        )
        message = (
            f"the engine's forward pass failed for the batch this request was in: "
            f"{type(error).__name__}: {error}; the request may succeed if sent again"
        )
        outputs = [self._end_with_error(seq, message) for seq in seqs]
        self.block_manager.forget_moves(decision.kv_moves)  # what the step wrote may not be there
        self.block_manager.forget(decision.cached_block_ids)  # their KV was never computed
        self._reset()
        return outputs

    def _drop_tier(self, decision: SchedulerOutput, error: KVTierError) -> None:
        """A tier failed before the step ran anything: the engine goes on without it. The step's
        plan is abandoned (what it wrote into the caches forgotten, its sequences queued again, to
        be planned without the tier), so no request fails."""
        log.error(
            "KV tier failed; the engine goes on without it",
            extra={"medium": error.medium, "error": str(error)},
        )
        self.block_manager.forget_moves(decision.kv_moves)
        self.block_manager.forget(decision.cached_block_ids)
        self.block_manager.disable_disk()
        self.scheduler.requeue([chunk.seq for chunk in decision.chunks])

    def _end_with_error(self, seq: Sequence, message: str, *, param: str | None = None) -> RequestOutput:
        """Retire ``seq`` now (its blocks and any lease freed) with ``message`` for its client
        (``param``: the request's field to blame)."""
        self._requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        self.release_held(seq.request_id)
        seq.finish_reason = "abort"
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="abort",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            error=message,
            error_param=param,
        )

    def _reset(self) -> None:
        """After a failed batch: the runner must be healthy and every KV block be held by a live
        sequence or a lease, or be free; else ``EngineResetError`` (the process must restart)."""
        try:
            self.runner.check_health()
            live = [*self.scheduler.running, *self.scheduler.waiting]
            self.block_manager.check_references([*(seq.block_table for seq in live), *self._held.values()])
        except Exception as error:
            raise EngineResetError(f"the engine cannot go on after a failed batch: {error}") from error

    def _hold_prompt(self, seq: Sequence) -> list[int]:
        """Hold the prompt's cached full blocks in the same step that finishes ``seq``: waiting for
        a later pause between steps could cost another request's whole prefill chunk."""
        num_full = seq.num_prompt_tokens // self.block_manager.block_size
        held = self.block_manager.hold_prefix(seq.block_hashes[:num_full])
        self._held[seq.request_id] = held
        return held

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if seq.grammar is not None and seq.grammar.is_finished:
            return "stop"
        is_eos = not params.ignore_eos and token_id in self.renderer.eos_token_ids
        if (is_eos or token_id in params.stop_token_ids) and seq.num_output_tokens >= params.min_tokens:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def load_report(self) -> LoadReport:
        waiting = self.scheduler.waiting
        return LoadReport(
            max_loras=self.config.max_loras,
            lora_adapters=list(self.lora_adapters),
            running_lora_adapters=_adapters(self.scheduler.running),
            waiting_lora_adapters=_adapters(waiting),
            num_running=len(self.scheduler.running),
            num_waiting=len(waiting),
            num_waiting_prefill_tokens=sum(seq.num_uncomputed_tokens for seq in waiting),
            kv_usage=min(1.0, max(0.0, self.block_manager.usage)),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_total_blocks,
            bytes_per_block=self.runner.geometry.bytes_per_block,
            max_batch_tokens=self.scheduler.max_batch_tokens,
            prefill_tokens_per_s=self.runner.measured.prefill.per_second,
            decode_step_s=self.runner.measured.decode_step_s,
            restore_bytes_per_s=self.runner.measured.restore_bytes_per_s(),
            pull_bytes_per_s=self.runner.measured.pull.per_second,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache if no request or lease holds a block; whether it did."""
        if not self.block_manager.can_reset_prefix_cache():
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_manager.events.drain()

    def kv_snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            epoch=self.info.epoch,
            seq=self.block_manager.events.last_seq,
            block_size=self.block_manager.block_size,
            block_hashes=self.block_manager.cached_hashes(),
            tier_block_hashes={tier.medium: tier.hashes() for tier in self.block_manager.tiers()},
        )

    # Disaggregation: whole KV blocks leave a prefill engine and enter a decode engine's cache.

    def close(self) -> None:
        """Stop the runner's other ranks, if any; the engine runs no step afterwards."""
        self.runner.close()

    def release_held(self, request_id: str) -> int:
        """Release the blocks a finished ``hold_prompt_blocks`` request holds; how many (0 if none)."""
        held = self._held.pop(request_id, [])
        self.block_manager.release(held)
        return len(held)

    def hold_cached(self, request_id: str, block_hashes: list[BlockHash]) -> HeldRun:
        """Hold the leading run of ``block_hashes`` the device cache has, or the host tier (restored
        onto the device first), for a peer to pull under a lease named ``request_id``
        (``release_held`` ends it): the held block ids (none if a tier failed on the way) and why
        the run ended where it did."""
        held = self.block_manager.hold_prefix(block_hashes, restore=True)
        if not self._make_moves():
            self.block_manager.release(held)
            return HeldRun([], "tier_failed")
        if held:
            self._held[request_id] = held
        return HeldRun(held, self.block_manager.run_end(block_hashes, len(held)))

    def record_pull(self, num_bytes: int, seconds: float) -> None:
        """A fetch of KV blocks from a peer took ``seconds``: the load report's pull bandwidth."""
        self.runner.measured.pull.add(num_bytes, seconds)

    def missing_blocks(self, block_hashes: list[BlockHash]) -> list[int]:
        """Indexes of the ``block_hashes`` neither this engine's prefix cache nor a tier below it
        holds (a tier's block is restored, not fetched).

        Safe beside a step (each lookup is atomic); the answer may be stale by then, which
        ``write_blocks`` tolerates: it skips blocks cached meanwhile.
        """
        cached, tiers = self.block_manager.cached, self.block_manager.tiers()
        return [
            index
            for index, block_hash in enumerate(block_hashes)
            if block_hash not in cached and not any(block_hash in tier.slots for tier in tiers)
        ]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy of the blocks' KV: ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.

        Safe beside a step for blocks held by ``hold_prompt_blocks``: no step writes or reallocates them.
        """
        return self.runner.read_blocks(block_ids)

    def write_blocks(
        self,
        block_hashes: list[BlockHash],
        token_blocks: list[list[int]],
        kv: torch.Tensor,
        lora_name: str | None = None,
    ) -> int:
        """Import peer blocks (KV laid out as ``read_blocks`` gives it, computed with adapter
        ``lora_name``, which their hashes carry) into the prefix cache.

        Blocks already cached here are skipped; returns how many were imported.
        """
        targets = [
            self.block_manager.import_block(block_hash, token_ids, lora_name)
            for block_hash, token_ids in zip(block_hashes, token_blocks, strict=True)
        ]
        imported = [block_id for block_id in targets if block_id is not None]
        self._make_moves()
        if imported:
            try:
                self.runner.write_blocks(targets, kv)
            except Exception:
                # Their hashes are registered already: they must not name KV that was never written.
                self.block_manager.forget(imported)
                self.block_manager.release(imported)
                raise
        self.block_manager.release(imported)
        return len(imported)

    def _make_moves(self) -> bool:
        """Make the moves planned outside a step (an import's evictions, a lease's restores) before
        the blocks they leave are written or read; whether they were made. A failing tier is dropped
        as in a step, and the device blocks it should have restored are forgotten."""
        moves, restored = self.block_manager.end_plan()
        try:
            self.runner.move_blocks(moves)
        except KVTierError as error:
            log.error("KV tier failed; the engine goes on without it", extra={"medium": error.medium})
            self.block_manager.forget_moves(moves)
            self.block_manager.forget(restored)
            self.block_manager.disable_disk()
            return False
        return True

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one aggregated ``RequestOutput`` per prompt, in order."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, request_params in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, request_params)
        results = {request_id: _empty_result(request_id) for request_id in ids}
        while any(not results[request_id].finished for request_id in ids):
            for output in self.step():
                if output.request_id in results:
                    _merge(results[output.request_id], output)
        return [results[request_id] for request_id in ids]


def _resume(
    seq: Sequence,
    detokenizer: IncrementalDetokenizer,
    token_ids: SequenceOf[int],
    finish_reason: Callable[[Sequence, int], FinishReason | None],
) -> RequestOutput:
    """Append the output tokens another worker streamed, token by token as they were sampled there
    (the stop-string window depends on ``min_tokens`` at each one); their text is the output's."""
    parts = []
    for token_id in token_ids:
        if seq.grammar is not None:
            _resumed_check(seq.grammar.accepts(token_id), f"token {token_id} breaks the output's grammar")
            seq.grammar.advance(token_id)
        seq.append_token(token_id, None)
        may_stop = seq.num_output_tokens >= seq.params.min_tokens
        parts.append(detokenizer.add([token_id], may_stop=may_stop))
        _resumed_check(
            finish_reason(seq, token_id) is None and not detokenizer.is_stopped,
            f"the choice would have finished at its token {seq.num_output_tokens}",
        )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=list(token_ids),
        new_text="".join(parts),
        finished=False,
        finish_reason=None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=0,
        num_output_tokens=seq.num_output_tokens,
        is_resumed=True,
    )


def _resumed_check(is_ok: bool, problem: str) -> None:
    if not is_ok:
        raise InvalidParamError(
            RESUME_FIELD, f"{RESUME_FIELD} holds output tokens this request cannot have produced: {problem}"
        )


def _adapters(seqs: Iterable[Sequence]) -> list[str]:
    return list(dict.fromkeys(seq.lora_name for seq in seqs if seq.lora_name is not None))


def _embedding_info(pooling: PoolingConfig | None) -> dict[str, Any]:
    """The ``WorkerInfo`` fields of an embedding model (none for a generation model)."""
    if pooling is None:
        return {}
    dims = pooling.matryoshka_dimensions
    return {
        "embedding_size": pooling.size,
        "is_normalized": pooling.normalize,
        "is_matryoshka": pooling.is_matryoshka,
        "matryoshka_dimensions": None if dims is None else list(dims),
    }


def _empty_result(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", False, None, 0, 0, 0, logprobs=[])


def _merge(result: RequestOutput, output: RequestOutput) -> None:
    result.new_token_ids.extend(output.new_token_ids)
    result.new_text += output.new_text
    result.finished, result.finish_reason = output.finished, output.finish_reason
    result.num_prompt_tokens, result.num_cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
    result.num_output_tokens = output.num_output_tokens
    result.error = output.error
    result.embedding = output.embedding
    if result.logprobs is not None and output.logprobs:
        result.logprobs.extend(output.logprobs)
