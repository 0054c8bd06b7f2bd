"""Preparing a request for its routing decision: parse, find its model, tokenize, read its session pin.

Every edge over the decision (herd's gateway, the endpoint picker) prepares a request the same way,
so the same body yields the same ``RequestContext`` and so the same choice:

1. the body is parsed with its route's OpenAI wire model (``herd.orchestrator.validation``);
2. its model is looked up among those served, or among their LoRA adapters (404 naming the served
   ones otherwise);
3. a completion for a model that routes by tokens, or serves disaggregated, or one that carries latency
   targets (``x-slo-*``: the SLO choice predicts from prompt lengths) has its prompt rendered,
   tokenized, length-checked against maxModelLen and hashed (with its LoRA adapter, as the workers hash
   it), once. A body of ``inline_bytes`` or more is parsed
   and tokenized on a small thread pool, so a multi-MB prompt never stalls the event loop
   (tokenization releases the GIL); a smaller one costs less inline than the hop to a thread, whose
   lowered priority makes it wait behind every busy process on a contended host;
4. the session's pin is read when the model's strategy pins sessions.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from herd.api.errors import HttpError
from herd.api.kv_hash import block_hashes
from herd.api.openai import LengthError
from herd.api.prompt import PromptError, PromptThreads
from herd.orchestrator.admission.targets import has_slo_headers
from herd.orchestrator.registry import Registry
from herd.orchestrator.routing import RequestContext, pin_key
from herd.orchestrator.served import RendererUnavailableError, ServedModel
from herd.orchestrator.state import State
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.validation import ParsedRequest, check_length, parse_request

__all__ = ["INLINE_PREPARE_BYTES", "Prepared", "Preparer"]

log = logging.getLogger(__name__)

INLINE_PREPARE_BYTES = 4096
"""Bodies below this size are prepared inline: a chat prompt of up to ~1k tokens takes a few ms to
parse, render, tokenize and hash, while the prompt threads' hop (niced 10 below the loop) waited 80 ms
at p50 and up to 13 s with the host's cores busy (issue 14; docs/routing.md)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for ``decide``: its model, its parsed body and its routing context."""

    served: ServedModel
    parsed: ParsedRequest
    ctx: RequestContext


class Preparer:
    """Prepares requests for the models a registry serves; owns the prompt threads."""

    def __init__(
        self,
        registry: Registry,
        state: State,
        *,
        inline_bytes: int = INLINE_PREPARE_BYTES,
        num_threads: int = 2,
    ) -> None:
        self.registry = registry
        self.state = state
        self._threads = PromptThreads("herd-prepare", num_threads, inline_bytes=inline_bytes)
        self._untokenized: weakref.WeakSet[ServedModel] = weakref.WeakSet()
        """Models already logged as routed without tokens (once each)."""

    def close(self) -> None:
        self._threads.close()

    async def prepare(self, path: str, body: bytes, headers: Mapping[str, str]) -> Prepared:
        """``body`` of route ``path`` parsed and tokenized for its model; ``HttpError`` when it cannot be.
        ``headers`` is looked up by lower-case name (the session header)."""
        parsed = await self._threads.run_sized(len(body), parse_request, path, body)
        served, lora_name = self.served(parsed.request.model)
        ctx = await self._context(served, parsed, headers, len(body), lora_name)
        return Prepared(served, parsed, ctx)

    def served(self, model: str) -> tuple[ServedModel, str | None]:
        """The served model ``model`` names, and its LoRA adapter when it names one; 404 otherwise."""
        resolved = self.registry.resolve(model)
        if resolved is None:
            known = ", ".join(sorted(self.registry.models)) or "none"
            raise HttpError(
                404,
                f"model {model!r} is not served here, neither a model nor a LoRA adapter (served: {known}); "
                "see GET /v1/models",
                param="model",
            )
        return resolved

    async def _context(
        self,
        served: ServedModel,
        parsed: ParsedRequest,
        headers: Mapping[str, str],
        size: int,
        lora_name: str | None,
    ) -> RequestContext:
        # A request with latency targets is tokenized whatever the strategy: the SLO choice predicts
        # from its uncached prompt and from the prefill tokens in flight on each worker, both 0 without.
        is_tokenized = parsed.generates and (served.needs_tokens or has_slo_headers(headers))
        token_ids, hashes = await self._tokens(served, parsed, size, lora_name) if is_tokenized else ((), ())
        session_key = headers.get(served.session_header)
        pinned = None
        if served.strategy.pins_sessions and session_key:
            pinned = await self.state.get_pin(pin_key(served.name, session_key))
        return RequestContext(
            model=served.name,
            token_ids=token_ids,
            block_hashes=hashes,
            session_key=session_key,
            pinned_worker_id=pinned,
            headers=headers,  # the caller's read-only mapping: no copy per request
            lora_name=lora_name,
        )

    async def _tokens(
        self, served: ServedModel, parsed: ParsedRequest, size: int, lora_name: str | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prompt's token ids and block hashes; none (the strategy's load-only fallback) while no
        tokenizer is known."""
        threads = self._threads
        try:
            if not served.has_renderer:  # the first prompt loads the tokenizer (~0.7 s): never on the loop
                return await threads.run(_tokenize, served, parsed, lora_name)
            return await threads.run_sized(size, _tokenize, served, parsed, lora_name)
        except RendererUnavailableError as error:
            if served not in self._untokenized:
                self._untokenized.add(served)
                log.warning(
                    "routing without tokens (least in-flight) until the tokenizer is fetched",
                    extra={"model": served.name, "reason": str(error)},
                )
            return (), ()
        except LengthError as error:
            raise HttpError(400, str(error), param=error.param) from None
        except PromptError as error:
            raise HttpError(400, str(error), param=parsed.prompt_param) from None


def _tokenize(
    served: ServedModel, parsed: ParsedRequest, lora_name: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt's token ids, checked against maxModelLen, and its block hashes (may run on a thread)."""
    config = served.config
    token_ids = tuple(prompt_token_ids(served.renderer, parsed.request, max_model_len=config.max_model_len))
    check_length(parsed, len(token_ids), config.max_model_len)
    hashes = block_hashes(
        token_ids,
        config.block_size,
        model_id=served.name,
        cache_salt=parsed.request.cache_salt,
        lora_name=lora_name,
    )
    return token_ids, tuple(hashes)
