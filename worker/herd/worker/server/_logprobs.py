"""Engine logprobs (token ids) as OpenAI logprobs (token strings): chat's objects, completions' lists."""

from __future__ import annotations

from herd.api.openai import CompletionLogprobs, Logprobs, TokenLogprob, TopLogprob
from herd.api.prompt import PromptRenderer
from herd.worker import outputs

__all__ = ["chat_logprobs", "completion_logprobs"]


def chat_logprobs(renderer: PromptRenderer, entries: list[outputs.TokenLogprob]) -> Logprobs:
    return Logprobs(content=[_chat_entry(renderer, entry) for entry in entries])


def _chat_entry(renderer: PromptRenderer, entry: outputs.TokenLogprob) -> TokenLogprob:
    token, *alternatives = renderer.token_strings([entry.token_id, *(token_id for token_id, _ in entry.top)])
    top = [
        TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
        for text, (_, logprob) in zip(alternatives, entry.top, strict=True)
    ]
    return TokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)


def completion_logprobs(
    renderer: PromptRenderer, entries: list[outputs.TokenLogprob], *, offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions layout; ``offset`` is where these tokens start in the choice's text.

    Returns the logprobs and the offset just past them, for the next chunk of a stream.
    """
    result = CompletionLogprobs()
    for entry in entries:
        token, *alternatives = renderer.token_strings(
            [entry.token_id, *(token_id for token_id, _ in entry.top)]
        )
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(
            {text: logprob for text, (_, logprob) in zip(alternatives, entry.top, strict=True)}
        )
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset
