"""The autoscaler loop: every interval, each ModelDeployment with ``spec.autoscaling.enabled`` is
scraped, decided (``autoscale.decide``) and, when the decision differs, scaled.

Source of truth: the scaler writes ``spec.replicas`` through the scale subresource, exactly what
``kubectl scale`` does. The reconcile already plans the scalable pool (``workers``, or ``decode``
when disaggregated) from ``spec.replicas``, so the Deployment, ``status.replicas``, ``kubectl get md``
and the reconcile all agree, and a manual ``kubectl scale`` is simply the next starting point.
Only that pool scales; a disaggregated prefill pool keeps its own ``replicas``.

One asyncio task per operator, started and stopped with it, rather than a kopf timer or daemon:
those add a finalizer to every ModelDeployment, and a finalizer blocks ``kubectl delete`` while the
operator is down. The cost: the loop does not take part in kopf's peering, so run one operator
replica (the chart does). The decision history lives in memory; after a restart the scaler waits a
whole stabilization window before scaling down (``quiet_s`` counts from its start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from herd.api.crd import API_VERSION, KIND, PLURAL, ModelDeployment, PoolName
from herd.operator.autoscale import Decision, Observation, Recommendation, ScaleState, decide
from herd.operator.kube import KubeApi, KubeError, resource_path
from herd.operator.metrics_source import Scrape, metrics_url, observe, scrape_all
from herd.operator.plan import pool_labels, selector_string
from herd.operator.settings import AutoscalerSettings
from herd.operator.status import is_pod_ready

__all__ = ["Autoscaler", "scalable_pool"]

Object = dict[str, Any]
_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_log = logging.getLogger("herd.operator.autoscaler")


@dataclass
class _Memory:
    """What the scaler keeps per ModelDeployment between rounds."""

    started: float
    scrapes: dict[str, Scrape] = field(default_factory=dict)
    history: list[Recommendation] = field(default_factory=list)

    def remember(self, recommendation: Recommendation, window_s: float) -> None:
        """Keep the recommendations the stabilization window still looks at, and this one."""
        since = recommendation.at - window_s
        self.history = [r for r in self.history if r.at >= since] + [recommendation]


def scalable_pool(md: ModelDeployment) -> PoolName:
    return "decode" if md.spec.serving.mode == "disaggregated" else "workers"


class Autoscaler:
    """Scales ModelDeployments in ``namespaces`` (every namespace when empty) every interval."""

    def __init__(self, api: KubeApi, settings: AutoscalerSettings, namespaces: Sequence[str] = ()) -> None:
        self.api = api
        self.settings = settings
        self.namespaces = list(namespaces)
        self.scraper = httpx.AsyncClient(timeout=settings.scrape_timeout_s)
        self._memory: dict[tuple[str, str], _Memory] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="herd-autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scraper.aclose()

    async def _run(self) -> None:
        while True:
            await self.run_once()
            await asyncio.sleep(self.settings.interval_s)

    async def run_once(self) -> None:
        """One decision for every enabled ModelDeployment; a failure is logged and retried next round."""
        try:
            bodies = await self._list()
        except (httpx.HTTPError, KeyError, ValueError) as error:
            _log.warning(f"autoscaler: cannot list ModelDeployments ({error}); retrying next round")
            return
        seen = set()
        for body in bodies:
            meta = body["metadata"]
            key = (meta["namespace"], meta["name"])
            if (body.get("spec", {}).get("autoscaling") or {}).get("enabled"):
                seen.add(key)
            await self._visit(body, key, is_enabled=key in seen)
        self._memory = {key: memory for key, memory in self._memory.items() if key in seen}

    async def _visit(self, body: Object, key: tuple[str, str], *, is_enabled: bool) -> None:
        try:
            if is_enabled:
                await self._scale(body, key)
            elif (body.get("status") or {}).get("autoscaling"):
                # A decision left from before autoscaling was switched off would mislead.
                await self.api.patch_status(API_VERSION, PLURAL, *key, {"autoscaling": None})
        except (KubeError, httpx.HTTPError) as error:
            _log.warning(f"autoscaler: {key[0]}/{key[1]}: {error}; retrying next round")
        except Exception:  # one ModelDeployment's bug must not stop the scaling of every other one
            _log.exception(f"autoscaler: {key[0]}/{key[1]}: unexpected error; retrying next round")

    async def _list(self) -> list[Object]:
        paths = [resource_path(API_VERSION, PLURAL, ns) for ns in self.namespaces]
        items: list[Object] = []
        for path in paths or [f"/apis/{API_VERSION}/{PLURAL}"]:
            response = await self.api.http.get(path)
            response.raise_for_status()
            items += response.json()["items"]
        return items

    async def _scale(self, body: Object, key: tuple[str, str]) -> None:
        try:
            md = ModelDeployment.model_validate(
                {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")}
            )
        except ValidationError:
            return  # the reconcile reports an invalid spec in the status; nothing to scale
        now = time.time()
        memory = self._memory.setdefault(key, _Memory(started=now))
        current = md.spec.pools()[scalable_pool(md)].replicas
        observed, num_ready = await self._observe(md, memory)
        previous = (body.get("status") or {}).get("autoscaling") or {}
        last_scale = max(memory.started, _epoch(previous.get("lastScaleTime")))
        state = ScaleState(current, num_ready, now, now - last_scale, tuple(memory.history))
        decision = decide(state, observed, md.spec.autoscaling, self.settings)
        memory.remember(Recommendation(now, decision.recommendation), self.settings.stabilization_s)
        if decision.desired != current:
            await self._apply(body, current, decision)
            previous = {**previous, "lastScaleTime": _timestamp(now)}
        await self._record(body, previous, decision, observed)

    async def _observe(self, md: ModelDeployment, memory: _Memory) -> tuple[Observation, int]:
        selector = selector_string(pool_labels(md.metadata.name, scalable_pool(md)))
        pods = await self.api.list("v1", "pods", md.metadata.namespace, selector)
        ready = [pod for pod in pods if is_pod_ready(pod)]
        urls = {pod["metadata"]["name"]: metrics_url(pod) for pod in ready}
        scrapes = await scrape_all(self.scraper, urls)
        observed = observe(memory.scrapes, scrapes)
        memory.scrapes = {pod: scrape for pod, scrape in scrapes.items() if scrape is not None}
        return observed, len(ready)

    async def _apply(self, body: Object, current: int, decision: Decision) -> None:
        meta = body["metadata"]
        path = resource_path(API_VERSION, PLURAL, meta["namespace"], meta["name"]) + "/scale"
        patch = {"spec": {"replicas": decision.desired}}
        response = await self.api.http.patch(path, json=patch, headers=_MERGE_PATCH)
        response.raise_for_status()
        verb = "ScaledUp" if decision.desired > current else "ScaledDown"
        message = f"replicas {current} -> {decision.desired}: {decision.reason}"
        _log.info(f"autoscaler: {meta['namespace']}/{meta['name']} {message}")
        await self.api.create("v1", "events", _event(body, verb, message))

    async def _record(
        self, body: Object, previous: Object, decision: Decision, observed: Observation
    ) -> None:
        figures = {
            "ttftP95Ms": observed.ttft_p95_ms,
            "itlP95Ms": observed.itl_p95_ms,
            "numRequestsWaiting": observed.num_waiting,
            "kvCacheUsage": observed.kv_usage,
        }
        status = {
            "desiredReplicas": decision.desired,
            "lastScaleTime": previous.get("lastScaleTime"),
            "reason": decision.reason,
            "observed": _present(figures),
        }
        status = _present(status)  # a null in a merge patch deletes the field; leave it out instead
        old = (body.get("status") or {}).get("autoscaling")
        if status != old:
            meta = body["metadata"]
            await self.api.patch_status(
                API_VERSION, PLURAL, meta["namespace"], meta["name"], {"autoscaling": status}
            )


def _event(body: Object, reason: str, message: str) -> Object:
    """A core/v1 Event about ``body``, posted directly: kopf's event queue only serves its handlers."""
    meta = body["metadata"]
    now = _timestamp(time.time())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": "Normal",
        "reason": reason,
        "message": message,
        "source": {"component": "herd-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _present(fields: Object) -> Object:
    return {key: value for key, value in fields.items() if value is not None}


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime(_TIME_FORMAT)


def _epoch(timestamp: str | None) -> float:
    if not timestamp:
        return 0.0
    return datetime.strptime(timestamp, _TIME_FORMAT).replace(tzinfo=UTC).timestamp()
