"""Grammar-constrained decoding with llguidance: compiled grammars, per-sequence matchers, batch masks.

A request's constraint (a JSON schema, a regex, a choice list, a Lark grammar) is a ``GrammarSpec``.
``GrammarCompiler.compile`` turns a spec into a ``CompiledGrammar`` on the caller's thread (the
server's prompt threads, never the engine's step thread) and keeps the last ``cache_size`` of them
(an LRU keyed by the spec), so a schema sent again costs a dictionary lookup. A grammar that does not
compile, or that admits no output at all, raises ``InvalidParamError`` naming the request field.

A compiled grammar holds one pristine llguidance matcher that nobody advances; each sequence gets a
copy (``CompiledGrammar.matcher``, microseconds: the lexer and the parser tables are shared). Every
step, ``MaskFiller`` computes the allowed-token bitmask of every constrained sequence of the batch in
one call that llguidance spreads over its own threads (without the GIL), on a side thread of its own
while the forward pass runs (``start``); ``apply_bitmask`` then sets the logits of disallowed tokens
to -inf for those rows only, so free requests in the same batch pay nothing. The engine advances a
sequence's matcher with each token it appends, sampled here or handed over by a prefill worker; a
matcher that has stopped (its grammar is complete) finishes the sequence. Preemption keeps the tokens
and so the matcher's position.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance
import torch

from herd.worker.sampling_params import InvalidParamError

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "JSON_OPTIONS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "MaskFiller",
    "PendingMasks",
    "allowed_token_ids",
    "apply_bitmask",
]

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept per worker; each holds its lexer tables (kilobytes to a few megabytes)."""

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written compactly (``json.dumps``'s separators): free whitespace lets a model pad an
object with blanks until its token budget runs out, a known failure of small models."""

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]

_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A sequence's token that its grammar does not accept (a handed-over token, a matcher fault,
    such as a grammar past llguidance's resource limits): the request's own field ``param`` failed,
    so its client is told so (a 400), not that the server did."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    @property
    def summary(self) -> str:
        """The first line of the matcher's report (the rest is its state dump, for the log)."""
        return str(self).partition("\n")[0]


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: ``kind`` and its text (a JSON schema as JSON text, its key order
    kept since properties are written in that order, a regex,
    a JSON list of choices, a Lark or GBNF grammar). ``param`` names the request field it came from."""

    kind: GrammarKind
    source: str
    param: str = field(default="response_format", compare=False)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    def to_llguidance(self) -> str:
        """The llguidance grammar; raises ``ValueError`` for a spec it cannot read."""
        match self.kind:
            case "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            case "choice":
                return llguidance.grammar_from("choice", self.source)
            case "grammar":
                return llguidance.grammar_from("grammar", self.source)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher", "num_words", "param")

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, param: str) -> None:
        self._matcher = matcher
        self.num_words = num_words
        self.param = param
        """The request field the grammar came from (``GrammarSpec.param``)."""

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accepts(self, token_id: int) -> bool:
        return not self._matcher.is_error() and self._matcher.validate_tokens([token_id]) == 1

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(
                f"token {token_id} breaks the output's grammar: {self._matcher.get_error()}", self.param
            )

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: no token but an end-of-sequence one may follow."""
        return self._matcher.is_stopped()

    def check(self) -> None:
        """Raise ``GrammarError`` if the matcher failed (a resource limit of its grammar, say)."""
        if self._matcher.is_error():
            raise GrammarError(f"the output's grammar failed: {self._matcher.get_error()}", self.param)


class CompiledGrammar:
    """A grammar compiled for one tokenizer; ``matcher()`` starts a sequence in it."""

    def __init__(self, spec: GrammarSpec, pristine: llguidance.LLMatcher, num_words: int) -> None:
        self.spec = spec
        self._pristine = pristine
        self.num_words = num_words

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy(), self.num_words, self.spec.param)


class GrammarCompiler:
    """Compiles specs for one model's tokenizer, caching the last ``cache_size``; thread-safe.

    The llguidance tokenizer (its token trie) is built at the first compile: about a second for a
    50k-token vocabulary, paid by the first constrained request on a prompt thread.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Collection[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        tokenizer = self._llg_tokenizer()
        try:
            grammar = spec.to_llguidance()
        except ValueError as error:
            raise InvalidParamError(spec.param, f"{spec.param} cannot be compiled: {error}") from None
        pristine = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise InvalidParamError(spec.param, f"{spec.param} cannot be compiled: {pristine.get_error()}")
        compiled = CompiledGrammar(spec, pristine, -(-tokenizer.vocab_size // 32))
        _check_first_step(compiled)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
                )
            return self._tokenizer


def _check_first_step(compiled: CompiledGrammar) -> None:
    """Refuse a grammar with no first step, on a fresh copy (the pristine matcher is only ever
    copied, never advanced)."""
    matcher = compiled.matcher()
    bitmask = MaskFiller.fill_now([matcher])
    if matcher.matcher.is_error() or not bitmask.any():
        param = compiled.spec.param
        raise InvalidParamError(param, f"{param} admits no output at all: no text can match it")


@dataclass(frozen=True)
class PendingMasks:
    """The bitmasks of a batch's constrained rows, being computed beside the forward pass."""

    rows: list[int]
    """The sampled rows (indexes into the step's sampled sequences) that have a grammar."""
    future: Future[torch.Tensor]

    def result(self) -> torch.Tensor:
        """``[len(rows), num_words]`` int32, bit ``t`` of a row set when token ``t`` is allowed."""
        return self.future.result()


class MaskFiller:
    """Computes a batch's bitmasks, with llguidance's thread pool, on a side thread of its own."""

    _executor: llguidance.LLExecutor | None = None
    _executor_lock = threading.Lock()

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="herd-grammar")

    def start(self, matchers: list[GrammarMatcher | None]) -> PendingMasks | None:
        """Start the masks of the constrained entries of ``matchers``; None when there are none."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        constrained = [matcher for matcher in matchers if matcher is not None]
        return PendingMasks(rows, self._thread.submit(self.fill_now, constrained))

    @classmethod
    def fill_now(cls, matchers: list[GrammarMatcher]) -> torch.Tensor:
        num_words = matchers[0].num_words
        bitmask = torch.zeros((len(matchers), num_words), dtype=torch.int32)
        pairs = [(matcher.matcher, index) for index, matcher in enumerate(matchers)]
        # llguidance.torch would do the same, but importing it compiles a kernel with torch.compile.
        cls._shared_executor().unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), num_words * 4, len(matchers)
        )
        return bitmask

    @classmethod
    def _shared_executor(cls) -> llguidance.LLExecutor:
        with cls._executor_lock:
            if cls._executor is None:
                cls._executor = llguidance.LLExecutor()
            return cls._executor

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` booleans from ``[rows, words]`` int32 bitmasks (bit ``t % 32`` of word
    ``t // 32`` is token ``t``)."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set ``logits[rows]`` of the tokens each row's bitmask disallows to -inf, in place.

    If a row's own edits (``min_tokens`` hiding the end of sequence) left none of its allowed tokens
    finite, the grammar wins: the row becomes uniform over the allowed tokens.
    """
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = _unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    if allowed.shape[-1] < logits.shape[-1]:  # a model whose output layer is wider than its tokenizer
        padding = allowed.new_zeros((allowed.shape[0], logits.shape[-1] - allowed.shape[-1]))
        allowed = torch.cat([allowed, padding], dim=-1)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(masked).all(dim=-1)
    if bool(empty.any()):
        masked[empty] = torch.zeros_like(masked[empty]).masked_fill(~allowed[empty], float("-inf"))
    logits[index] = masked


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one bitmask row allows, below ``vocab_size``."""
    allowed: list[int] = _unpack(bitmask_row.unsqueeze(0), vocab_size)[0].nonzero().flatten().tolist()
    return allowed
