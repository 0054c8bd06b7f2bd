"""Run the operator: kopf with herd's handler registry and a fresh memo and settings per run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import kopf

from herd.operator.handlers import registry
from herd.operator.settings import OperatorConfig

__all__ = ["run_operator"]

Flag = asyncio.Event | asyncio.Future[None] | threading.Event


async def run_operator(
    config: OperatorConfig,
    *,
    namespaces: Sequence[str] = (),
    standalone: bool = False,
    liveness_endpoint: str | None = None,
    stop_flag: Flag | None = None,
    ready_flag: Flag | None = None,
) -> None:
    """Serve ``namespaces``, or every namespace when none is named, until ``stop_flag`` or a signal."""
    await kopf.operator(
        registry=registry,
        settings=kopf.OperatorSettings(),
        memo=kopf.Memo(config=config, namespaces=list(namespaces)),
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        standalone=standalone,
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
