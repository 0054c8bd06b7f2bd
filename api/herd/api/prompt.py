"""Prompt rendering and tokenization, shared so the orchestrator and the worker agree token for token.

Block hashes (``herd.api.kv_hash``) are only comparable if both sides turn a request into the same
token ids, so both use this one class: the model folder's ``tokenizer.json`` (HF ``tokenizers``)
and its Jinja chat template, rendered the way ``transformers`` renders it (sandboxed, trimmed
blocks, ``raise_exception``). Chat prompts are tokenized without adding special tokens, since the
template writes them itself; text completions add them (a Llama BOS, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from herd.api.openai import ChatCompletionRequest, CompletionRequest, prompt_too_long
from herd.api.tools import ToolFormat, chat_messages, knows_tools, tool_format

__all__ = [
    "TOKENIZER_FILES",
    "PromptError",
    "PromptLimit",
    "PromptRenderer",
    "PromptThreads",
    "prompt_count",
    "read_tokenizer_files",
]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

PREPARE_NICENESS = 10
"""How much lower than the serving threads a prompt thread runs (Linux nice; 10 weighs about a tenth)."""
MAX_NICENESS = 19
INLINE_BYTES = 2048
"""Bodies below this size are parsed and tokenized inline: a thread hop costs more than the work
(1 KiB: 0.74 ms inline, 0.88 ms on a thread; 4 KiB: 3.7 vs 2.4 ms, bench/gateway_prepare_threshold.py)."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)
"""The model-folder files a ``PromptRenderer`` reads; nothing else of the folder matters to it."""
_EOS_CONFIG_FILES = ("generation_config.json", "config.json")


class PromptError(ValueError):
    """A prompt that cannot be rendered (bad messages for this template, no template, ...)."""


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The context a prompt must leave room in, and the request field that holds the prompt."""

    max_model_len: int
    param: str


def _raise_exception(message: str) -> None:
    raise PromptError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def read_tokenizer_files(folder: Path) -> dict[str, str]:
    """The texts of the folder's ``TOKENIZER_FILES`` that exist; the model configs cut to their EOS ids.

    ``config.json`` and ``generation_config.json`` matter only for ``eos_token_id``: keeping just that
    keeps what a worker sends the orchestrator small (``tokenizer.json`` is the one large file).
    """
    files: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.exists():
            text = path.read_text()
            if name in _EOS_CONFIG_FILES:
                text = json.dumps({"eos_token_id": _json_object(text).get("eos_token_id")})
            files[name] = text
    return files


def _json_object(text: str | None) -> dict[str, Any]:
    data = json.loads(text) if text else {}
    return data if isinstance(data, dict) else {}


def _eos_ids(files: Mapping[str, str], tokenizer: Tokenizer, eos: str | None) -> set[int]:
    ids: set[int] = set()
    for name in _EOS_CONFIG_FILES:
        value = _json_object(files.get(name)).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if eos is not None and (token_id := tokenizer.token_to_id(eos)) is not None:
        ids.add(token_id)
    return ids


_TEMPLATE_DATA_ERRORS = (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError)
"""What rendering raises when the template meets a value of the wrong kind (a number where it loops
or calls, a string where it indexes): the request's fault, never the server's."""


def prompt_count(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many prompts a text-or-ids field (``prompt``, ``input``) holds, without tokenizing: one for
    a string or a list of ids, else one per item (``PromptRenderer.prompt_ids`` returns one list each)."""
    if isinstance(prompt, str) or all(isinstance(item, int) for item in prompt):
        return 1
    return len(prompt)


class PromptRenderer:
    """Turns OpenAI messages or text into token ids, and token ids back into text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        files: Mapping[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.files: Mapping[str, str] = files or {}
        """The tokenizer files this renderer was built from (``from_files``); empty when built directly."""
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self._template: jinja2.Template | None = None
        self.knows_tools = knows_tools(chat_template)
        """Whether the chat template renders ``tools`` itself (``herd.api.tools``)."""
        self.tool_format: ToolFormat = tool_format(chat_template)
        """The format this model writes tool calls in."""
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            self._template = env.from_string(chat_template)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> PromptRenderer:
        """Load from a HF-format model folder (``tokenizer.json`` and ``tokenizer_config.json``)."""
        folder = Path(path)
        if not (folder / "tokenizer.json").exists():
            raise PromptError(f"{folder} has no tokenizer.json; herd needs a HF 'fast' tokenizer file")
        return cls.from_files(read_tokenizer_files(folder))

    @classmethod
    def from_files(cls, files: Mapping[str, str]) -> PromptRenderer:
        """Build from the texts of a model folder's tokenizer files, keyed by name (``TOKENIZER_FILES``).

        The one builder behind ``from_pretrained`` too, so a renderer built from the files a worker
        sends (``read_tokenizer_files`` of its folder) tokenizes exactly as the worker's own.
        """
        if "tokenizer.json" not in files:
            raise PromptError(
                "the tokenizer files lack tokenizer.json; herd needs a HF 'fast' tokenizer file"
            )
        tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        # A tokenizer.json may carry its own truncation and padding (sentence-transformers' BERT files
        # pad and cut to 128): herd checks lengths itself and never pads, so neither may apply.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config = _json_object(files.get("tokenizer_config.json"))
        template = config.get("chat_template")
        if template is None:
            template = files.get("chat_template.jinja")
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_ids = _eos_ids(files, tokenizer, eos)
        return cls(
            tokenizer,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            files=files,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise PromptError("this model has no chat template: use /v1/completions with a plain prompt")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **dict(template_kwargs or {}),
            )
        except jinja2.TemplateError as error:
            raise PromptError(f"the chat template failed on these messages: {error}") from None
        except _TEMPLATE_DATA_ERRORS as error:  # a value the template cannot use (chat_template_kwargs)
            raise PromptError(
                f"the chat template failed on these messages and chat_template_kwargs "
                f"({type(error).__name__}: {error})"
            ) from None

    def encode(
        self, text: str, *, add_special_tokens: bool = True, limit: PromptLimit | None = None
    ) -> list[int]:
        """The text's token ids; past ``limit`` a ``LengthError`` before the ids become a list."""
        # encode_batch releases the GIL while it tokenizes (encode holds it), so a server that runs
        # this in a thread keeps its event loop answering during a multi-MB prompt; same ids, same cost.
        try:
            encoding = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except (TypeError, UnicodeError):  # what the tokenizer raises for a lone UTF-16 surrogate
            raise PromptError(
                "the prompt holds text that is not valid Unicode (a lone surrogate, which a JSON "
                "\\ud800 escape can carry); send UTF-8 text"
            ) from None
        # Building the list holds the GIL for the whole of it (about 100 ms for 800k ids), so a prompt
        # that cannot fit is refused on its count alone.
        if limit is not None and len(encoding) >= limit.max_model_len:
            raise prompt_too_long(len(encoding), limit.max_model_len, prompt_param=limit.param)
        return list(encoding.ids)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        limit: PromptLimit | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False, limit=limit)

    def chat_request_ids(
        self, request: ChatCompletionRequest, *, max_model_len: int | None = None
    ) -> list[int]:
        """The prompt token ids of a chat request: the one rendering worker and router share.

        With ``max_model_len``, a prompt that leaves no room for output raises ``LengthError``.
        """
        text = self.render_chat_request(request)
        limit = None if max_model_len is None else PromptLimit(max_model_len, "messages")
        return self.encode(text, add_special_tokens=False, limit=limit)

    def render_chat_request(self, request: ChatCompletionRequest) -> str:
        """A chat request's prompt text; tools and tool calls reach the template as ``herd.api.tools`` says."""
        messages = chat_messages(request, template_knows_tools=self.knows_tools)
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.tools and self.knows_tools:
            template_kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
        return self.render_chat(
            messages, add_generation_prompt=request.add_generation_prompt, template_kwargs=template_kwargs
        )

    def completion_request_ids(
        self, request: CompletionRequest, *, max_model_len: int | None = None
    ) -> list[list[int]]:
        """One token id list per prompt of a completion request (text gets special tokens added).

        Raises ``PromptError`` for an empty token list or ids outside the vocabulary, and with
        ``max_model_len`` ``LengthError`` for a text prompt that leaves no room for output.
        """
        limit = None if max_model_len is None else PromptLimit(max_model_len, "prompt")
        return self.prompt_ids(request.prompt, param="prompt", limit=limit)

    def prompt_ids(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        *,
        param: str,
        limit: PromptLimit | None = None,
    ) -> list[list[int]]:
        """One token id list per item of a text-or-ids field (``prompt``, ``input``): a string, a
        list of strings, a list of ids or a list of id lists; text gets special tokens added."""
        if isinstance(prompt, str):
            return [self.encode(prompt, limit=limit)]
        items: list[Any] = list(prompt)
        if all(isinstance(item, int) for item in items):
            return [self._checked_ids(items, param)]
        return [
            self.encode(item, limit=limit) if isinstance(item, str) else self._checked_ids(list(item), param)
            for item in items
        ]

    def _checked_ids(self, token_ids: list[int], param: str) -> list[int]:
        if not token_ids:
            raise PromptError(f"{param} token lists must not be empty")
        vocab_size = self.vocab_size
        if bad := [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]:
            raise PromptError(f"{param} token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size})")
        return token_ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own text, for logprobs (byte-level pieces decoded one at a time)."""
        return [self.tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]


class PromptThreads:
    """A few threads that render and tokenize prompts off a server's event loop, below its priority.

    Tokenizing a multi-MB prompt takes seconds of CPU (the tokenizer releases the GIL meanwhile). On a
    busy host that time should come out of the new request's own wait, not out of the event loop's
    answers or the engine's steps that running streams wait on, so on Linux each of these threads
    lowers its own priority (``PREPARE_NICENESS``); elsewhere the call would renice the whole process,
    so they run as they are. The executor is their own: a queue of large prompts does not hold up the
    loop's default executor (host-name lookups, other blocking calls).
    """

    def __init__(self, name: str, num_threads: int = 2, *, inline_bytes: int = INLINE_BYTES) -> None:
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix=name, initializer=_lower_priority)
        self.inline_bytes = inline_bytes

    async def run(self, work: Callable[[*Ts], T], *args: *Ts) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    async def run_sized(self, size: int, work: Callable[[*Ts], T], *args: *Ts) -> T:
        """``work(*args)`` for a body of ``size`` bytes: inline under ``inline_bytes``, where the hop
        to a thread costs more than the work, else on these threads."""
        if size < self.inline_bytes:
            return work(*args)
        return await self.run(work, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    if sys.platform.startswith("linux"):  # per thread on Linux only
        thread = threading.get_native_id()
        with contextlib.suppress(OSError):
            niceness = os.getpriority(os.PRIO_PROCESS, thread) + PREPARE_NICENESS
            os.setpriority(os.PRIO_PROCESS, thread, min(MAX_NICENESS, niceness))
