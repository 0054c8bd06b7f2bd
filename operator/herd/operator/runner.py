"""Run the operator: kopf with herd's handler registry and a fresh memo and settings per run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import kopf

from herd.api.crd import API_VERSION, PLURAL
from herd.kube import load_connection
from herd.operator.handlers import registry
from herd.operator.kube import KubeApi
from herd.operator.settings import OperatorConfig

__all__ = ["CrdMissingError", "run_operator"]


class CrdMissingError(RuntimeError):
    """The ModelDeployment CRD is not installed, so the operator would never see a ModelDeployment."""


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
    await _require_crd(config, namespaces)
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


async def _require_crd(config: OperatorConfig, namespaces: Sequence[str]) -> None:
    """Refuse to start without the CRD: kopf decides what to watch from its first listing of CRDs and
    ignores one created afterwards, so an operator started first would never serve ModelDeployments."""
    async with load_connection(config.kubeconfig).http_client() as http:
        if not await KubeApi(http).serves(API_VERSION, PLURAL, namespaces[0] if namespaces else None):
            raise CrdMissingError(
                f"the API server does not serve {PLURAL}.{API_VERSION.split('/')[0]}: install the "
                "ModelDeployment CRD first (kubectl apply -f crds/, or helm install herd charts/herd), "
                "then start the operator"
            )
