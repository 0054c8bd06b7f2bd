"""From an OpenAI request to what the engine takes: prompt token ids and per-choice SamplingParams."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import ValidationError

from herd.api.errors import HttpError, invalid_request
from herd.api.openai import ChatCompletionRequest, CompletionRequest, LengthError, SamplingFields
from herd.api.prompt import PromptError, PromptRenderer
from herd.api.protocol import KVTransferParams
from herd.api.resume import RESUME_FIELD, ResumeParams
from herd.worker.grammar import CompiledGrammar
from herd.worker.sampling_params import InvalidParamError, SamplingParams, check_token_ids

__all__ = [
    "HANDED_PROMPT_PARAM",
    "MAX_SEQUENCES",
    "Choice",
    "chat_prompt",
    "completion_prompts",
    "first_token_params",
    "handed_first_token",
    "handed_prompt",
    "handoff_params",
    "plan_choices",
    "prompt_errors",
    "resume_params",
]


T = TypeVar("T")

HANDED_PROMPT_PARAM = "kv_transfer_params.prompt_token_ids"
"""The field errors about a prompt the orchestrator handed over name."""

MAX_SEQUENCES = 128
"""Sequences one request may start (``n`` times the number of prompts): each is a queued request."""


@dataclass(frozen=True)
class Choice:
    """One sequence the engine generates: choice ``index`` of the response, from prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int | None = None
    """The first output token, when a prefill worker sampled it (``handed_first_token``)."""
    resumed_token_ids: tuple[int, ...] = ()
    """Output tokens another worker already streamed (``herd.api.resume``)."""
    is_finished: bool = False
    """The choice ended on the worker that began the stream: nothing more to generate."""


def chat_prompt(renderer: PromptRenderer, request: ChatCompletionRequest, max_model_len: int) -> list[int]:
    with prompt_errors("messages"):
        return renderer.chat_request_ids(request, max_model_len=max_model_len)


def completion_prompts(
    renderer: PromptRenderer, request: CompletionRequest, max_model_len: int
) -> list[list[int]]:
    """One token list per prompt: text is tokenized (with special tokens), ids are checked."""
    with prompt_errors("prompt"):
        return renderer.completion_request_ids(request, max_model_len=max_model_len)


@contextlib.contextmanager
def prompt_errors(param: str) -> Iterator[None]:
    """Rendering or tokenizing the prompt in ``param`` failed: a 400 naming it (the field to change,
    for a prompt too long for the context)."""
    try:
        yield
    except LengthError as error:
        raise HttpError(400, str(error), param=error.param) from None
    except PromptError as error:
        raise HttpError(400, str(error), param=param) from None


def plan_choices(
    request: SamplingFields,
    prompts: list[list[int]],
    *,
    max_model_len: int,
    vocab_size: int | None,
    num_logprobs: int | None,
    prompt_param: str,
    handoff: KVTransferParams | None,
    grammar: CompiledGrammar | None = None,
    resume: ResumeParams | None = None,
) -> list[Choice]:
    """``n`` choices per prompt; seeded requests get ``seed + i`` for choice ``i`` of a prompt.

    Every token id and setting is checked against the model (``vocab_size``, None when the engine
    does not say: the engine's own check then answers), handed prompt ids included. A lone choice
    continues from the first token a prefill worker handed over (``handoff``), if it may. Every
    choice is held to ``grammar`` when there is one, each sequence with its own matcher. A resumed
    stream's choices carry the tokens already sent (``resume``; the engine checks them).
    """
    _check_count(request, prompts, prompt_param)
    choices: list[Choice] = []
    for prompt_index, prompt in enumerate(prompts):
        max_tokens = _max_tokens(request, len(prompt), max_model_len, prompt_param)
        for i in range(request.n):
            params = sampling_params(request, max_tokens=max_tokens, num_logprobs=num_logprobs, offset=i)
            params = params if grammar is None else replace(params, grammar=grammar)
            choices.append(Choice(len(choices), prompt_index, prompt, params))
    if vocab_size is not None:
        _check_vocab(choices, vocab_size, prompt_param)
    if resume is not None:
        return _resumed(choices, resume)
    if len(choices) == 1 and (first := handed_first_token(handoff, choices[0].params)) is not None:
        if vocab_size is not None:
            _checked(check_token_ids, [first], vocab_size, param="kv_transfer_params")
        choices[0] = replace(choices[0], first_token_id=first)
    return choices


def _resumed(choices: list[Choice], resume: ResumeParams) -> list[Choice]:
    """``choices`` with the tokens and ends of a resumed stream; a choice past its budget is a 400."""
    for given in resume.choices:
        if given.index >= len(choices):
            raise HttpError(
                400,
                f"{RESUME_FIELD} names choice {given.index} but the request has {len(choices)} choices",
                param=RESUME_FIELD,
            )
        choice = choices[given.index]
        if len(given.token_ids) >= choice.params.max_tokens and not given.is_finished:
            raise HttpError(
                400,
                f"{RESUME_FIELD} gives choice {given.index} {len(given.token_ids)} tokens, which ends it "
                f"(max_tokens {choice.params.max_tokens}), yet not finished",
                param=RESUME_FIELD,
            )
        choices[given.index] = replace(
            choice, resumed_token_ids=tuple(given.token_ids), is_finished=given.is_finished
        )
    return choices


def resume_params(request: SamplingFields) -> ResumeParams | None:
    """The request's ``herd_resume``, validated; only a stream resumes."""
    raw = (request.model_extra or {}).get(RESUME_FIELD)
    if raw is None:
        return None
    try:
        resume = ResumeParams.model_validate(raw)
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False), within=RESUME_FIELD) from None
    if not request.stream:
        raise HttpError(400, f"{RESUME_FIELD} continues a stream: set stream to true", param=RESUME_FIELD)
    return resume


def _check_count(request: SamplingFields, prompts: list[list[int]], prompt_param: str) -> None:
    if len(prompts) * request.n > MAX_SEQUENCES:
        raise HttpError(
            400,
            f"the request asks for {len(prompts) * request.n} sequences ({len(prompts)} prompts times "
            f"n={request.n}); send at most {MAX_SEQUENCES} per request",
            param="n" if request.n > 1 else prompt_param,
        )


def _check_vocab(choices: list[Choice], vocab_size: int, prompt_param: str) -> None:
    """Token ids in prompts (checked once per prompt) and settings against the model's vocabulary."""
    for choice in choices:
        if choice.index == 0 or choices[choice.index - 1].prompt_index != choice.prompt_index:
            _checked(check_token_ids, choice.prompt_token_ids, vocab_size, param=prompt_param)
        _checked(choice.params.check_vocab, vocab_size)


def handoff_params(request: SamplingFields) -> KVTransferParams | None:
    """The request's ``kv_transfer_params``, validated (once per hop: callers pass the result on)."""
    raw = (request.model_extra or {}).get("kv_transfer_params")
    if raw is None:
        return None
    try:
        return KVTransferParams.model_validate(raw)
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False), within="kv_transfer_params") from None


def handed_prompt(handoff: KVTransferParams | None) -> list[int] | None:
    """The prompt ids the orchestrator rendered, when the request carries them."""
    return None if handoff is None else handoff.prompt_token_ids


def handed_first_token(handoff: KVTransferParams | None, params: SamplingParams) -> int | None:
    """The first token in the request's ``kv_transfer_params``, when this choice may start from it.

    The prefill worker sampled it with the request's own settings (``first_token_params``), so a
    greedy or unseeded choice may. A seeded one samples it again, so that its draws stay those of a
    unified worker; one asking for logprobs too, since the prefill side returns none.
    """
    if handoff is None or params.seed is not None or params.logprobs is not None:
        return None
    if not handoff.do_remote_prefill or not handoff.first_token_ids or len(handoff.first_token_ids) != 1:
        return None
    return handoff.first_token_ids[0]


def first_token_params(params: SamplingParams) -> SamplingParams:
    """A prefill worker's settings for a request's first token: the request's own sampling, one
    token, the prompt's blocks held for the decode side."""
    return replace(
        params, max_tokens=1, min_tokens=min(params.min_tokens, 1), logprobs=None, hold_prompt_blocks=True
    )


def _max_tokens(
    request: SamplingFields, num_prompt_tokens: int, max_model_len: int, prompt_param: str
) -> int:
    try:
        return request.output_budget(num_prompt_tokens, max_model_len, prompt_param=prompt_param)
    except LengthError as error:
        raise HttpError(400, str(error), param=error.param) from None


def sampling_params(
    request: SamplingFields, *, max_tokens: int, num_logprobs: int | None, offset: int
) -> SamplingParams:
    return _checked(
        SamplingParams,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=None if request.seed is None else request.seed + offset,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias={int(token): bias for token, bias in (request.logit_bias or {}).items()},
        stop=tuple(request.stop_strings),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=num_logprobs,
        priority=request.priority or 0,
    )


def _checked(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(...)``, its ``InvalidParamError`` turned into a 400 naming the field."""
    try:
        return function(*args, **kwargs)
    except InvalidParamError as error:
        raise HttpError(400, str(error), param=error.param) from None
