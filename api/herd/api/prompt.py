"""Prompt rendering and tokenization, shared so the orchestrator and the worker agree token for token.

Block hashes (``herd.api.kv_hash``) are only comparable if both sides turn a request into the same
token ids, so both use this one class: the model folder's ``tokenizer.json`` (HF ``tokenizers``)
and its Jinja chat template, rendered the way ``transformers`` renders it (sandboxed, trimmed
blocks, ``raise_exception``). Chat prompts are tokenized without adding special tokens, since the
template writes them itself; text completions add them (a Llama BOS, say).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["PromptError", "PromptRenderer"]


class PromptError(ValueError):
    """A prompt that cannot be rendered (bad messages for this template, no template, ...)."""


def _raise_exception(message: str) -> None:
    raise PromptError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


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
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self._template: jinja2.Template | None = None
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
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.exists():
            raise PromptError(f"{folder} has no tokenizer.json; herd needs a HF 'fast' tokenizer file")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = cls._read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_ids = cls._eos_ids(folder, tokenizer, eos)
        return cls(tokenizer, chat_template=template, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}

    @classmethod
    def _eos_ids(cls, folder: Path, tokenizer: Tokenizer, eos: str | None) -> set[int]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            value = cls._read_json(folder / name).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        if eos is not None and (token_id := tokenizer.token_to_id(eos)) is not None:
            ids.add(token_id)
        return ids

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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own text, for logprobs (byte-level pieces decoded one at a time)."""
        return [self.tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]
