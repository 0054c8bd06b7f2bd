"""The engine a worker process runs, by the manifest's ``engine.backend``.

``herd`` is herd's torch engine on the model's weights; ``simulated`` is the same engine over the
cost-model runner on a ``SleepingClock``, so its steps take as long as the fitted cost model says,
in real time. ``vllm`` is not served by ``herd worker``: vLLM's own server runs the model, and
``herd sidecar`` speaks herd's worker contract for it.
"""

from __future__ import annotations

from herd.api.prompt import PromptRenderer
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.simulated_runner import SleepingClock, simulated_engine

__all__ = ["build_engine"]


def build_engine(config: EngineConfig, renderer: PromptRenderer | None = None) -> LLMEngine:
    """The engine of ``config.engine.backend``; ``renderer`` is shared by a fleet of simulated engines."""
    match config.engine.backend:
        case "herd":
            return torch_engine(config)
        case "simulated":
            return simulated_engine(config, clock=SleepingClock(), renderer=renderer)
        case "vllm":
            raise ValueError(
                "engine.backend vllm is served by vLLM's own server behind `herd sidecar`, not by "
                "`herd worker`: start those (herd up and the operator do), or set backend: herd or simulated"
            )
