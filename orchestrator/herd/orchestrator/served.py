"""One served model's routing state: its config, strategy, KV index and its tokenizer once known."""

from __future__ import annotations

from dataclasses import dataclass, field

from herd.api.prompt import PromptRenderer
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import RoutingStrategy, build_strategy
from herd.orchestrator.routing.latency import LatencyModel

__all__ = ["RendererUnavailableError", "ServedModel"]


class RendererUnavailableError(ValueError):
    """The model's tokenizer is not known yet: no local folder, and not yet fetched from a worker."""


@dataclass(eq=False)
class ServedModel:
    """Everything per model that routing needs; rebuilt when the model's config changes."""

    config: ModelConfig
    kv_index: KVIndex = field(default_factory=KVIndex)
    latency: LatencyModel = field(default_factory=LatencyModel)
    """Each worker's TTFT and time per output token, fitted from what it served (SLO-aware routing)."""
    strategy: RoutingStrategy = field(init=False)
    session_header: str = field(init=False)
    """The lower-cased header that carries a session key (``X-Session-ID`` unless the routing names one)."""
    _renderer: PromptRenderer | None = field(default=None, init=False, repr=False)
    lora_paths: dict[str, str] = field(default_factory=dict)
    """LoRA adapters loaded at runtime through the gateway (name -> folder on the workers): a
    worker routed one it lacks is asked to load it first."""

    def __post_init__(self) -> None:
        self.strategy = build_strategy(
            self.config.routing, kv_index=self.kv_index, block_size=self.config.block_size
        )
        self.session_header = getattr(self.config.routing, "session_header", "X-Session-ID").lower()

    @property
    def name(self) -> str:
        return self.config.served_name

    @property
    def needs_tokens(self) -> bool:
        """Routing or the disaggregated plan tokenizes this model's prompts."""
        return self.strategy.needs_tokens or self.config.mode == "disaggregated"

    @property
    def wants_worker_tokenizer(self) -> bool:
        """The tokenizer must come from the model's workers: needed, and no local folder holds it."""
        return self.needs_tokens and self._renderer is None and self.config.model_path is None

    @property
    def has_renderer(self) -> bool:
        """The tokenizer is loaded: ``renderer`` returns at once instead of reading the model folder."""
        return self._renderer is not None

    @property
    def renderer(self) -> PromptRenderer:
        """The model's tokenizer and chat template: its local folder first (loaded on first use),
        else the files fetched from a worker (``use_renderer``); raises ``RendererUnavailableError`` before.
        """
        if self._renderer is None:
            if self.config.model_path is None:
                raise RendererUnavailableError(
                    f"model {self.name!r} has no local model folder and its tokenizer has not been "
                    "fetched from a worker yet"
                )
            self._renderer = PromptRenderer.from_pretrained(self.config.model_path)
        return self._renderer

    def use_renderer(self, renderer: PromptRenderer) -> None:
        """Adopt the tokenizer a worker sent; a local model folder, when configured, still wins."""
        if self.config.model_path is None:
            self._renderer = renderer
