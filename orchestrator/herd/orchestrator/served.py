"""One served model's routing state: its config, strategy, KV index and (lazily) its tokenizer."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from herd.api.prompt import PromptRenderer
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import RoutingStrategy, build_strategy

__all__ = ["ServedModel"]


@dataclass(eq=False)
class ServedModel:
    """Everything per model that routing needs; rebuilt when the model's config changes."""

    config: ModelConfig
    kv_index: KVIndex = field(default_factory=KVIndex)
    strategy: RoutingStrategy = field(init=False)

    def __post_init__(self) -> None:
        self.strategy = build_strategy(self.config.routing, kv_index=self.kv_index)

    @property
    def name(self) -> str:
        return self.config.served_name

    @functools.cached_property
    def renderer(self) -> PromptRenderer:
        """The model's own tokenizer and chat template, loaded on first use."""
        if self.config.model_path is None:
            raise ValueError(
                f"model {self.name!r} routes by tokens ({self.config.routing.strategy}) but has no local "
                "model folder for its tokenizer: give the orchestrator the model path"
            )
        return PromptRenderer.from_pretrained(self.config.model_path)
