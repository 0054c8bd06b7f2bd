"""The autoscaler loop: every interval, each ModelDeployment with ``spec.autoscaling.enabled`` is
scraped, decided (``autoscale.decide``) and, when the decision differs, scaled.

Source of truth: for the serving pool (``workers``, or ``decode`` when disaggregated) the scaler
writes ``spec.replicas`` through the scale subresource, exactly what ``kubectl scale`` does. The
reconcile already plans that pool from ``spec.replicas``, so the Deployment, ``status.replicas``,
``kubectl get md`` and the reconcile all agree, and a manual ``kubectl scale`` is simply the next
starting point. A disaggregated prefill pool is scaled apart, on its own pods' figures, by a merge
patch of ``spec.prefill.replicas``; its decision is kept in ``status.autoscaling.prefill``.

Scale from zero: a pool at zero has no pod to report waiting requests, so the gateways that hold
them report them (``herd_router_requests_held``, herd.api.demand). The scaler reads the orchestrator
pods behind the orchestrator Service (``--orchestrator-service`` in ``--orchestrator-namespace``, or in
the ModelDeployment's namespace) every ``demand_interval_s`` for pools it left at zero, and decides at
once when requests are held, instead of waiting for the next round. Idleness (no request got a token,
runs, waits or is held) is counted per pool at its current size; ``scaleToZeroAfterSeconds`` of it
takes a ``minReplicas: 0`` pool to zero.

One asyncio task per operator, started and stopped with it, rather than a kopf timer or daemon:
those add a finalizer to every ModelDeployment, and a finalizer blocks ``kubectl delete`` while the
operator is down. The cost: the loop does not take part in kopf's peering, so run one operator
replica (the chart does). The decision history lives in memory; after a restart the scaler waits a
whole stabilization window before scaling down (``quiet_s`` counts from its start).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from herd.api.crd import API_VERSION, KIND, PLURAL, ModelDeployment, PoolName
from herd.api.demand import ModelDemand, parse_demand
from herd.kube import resource_path
from herd.operator.autoscale import (
    Decision,
    Observation,
    Recommendation,
    ScaleState,
    autoscaled_pools,
    decide,
    pool_bounds,
)
from herd.operator.kube import KubeApi, KubeError
from herd.operator.metrics_source import Scrape, metrics_url, observe, parse_scrape, scrape_all
from herd.operator.plan import pool_labels, selector_string
from herd.operator.settings import AutoscalerSettings, PlanSettings
from herd.operator.status import is_pod_ready

__all__ = ["Autoscaler", "merge_patch_between"]

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
    replicas: int | None = None
    idle_since: float = 0.0

    def idle_seconds(self, now: float, current: int, is_idle: bool) -> float:
        """How long the pool has been idle at its current size (a new size starts the count again)."""
        if current != self.replicas or not is_idle:
            self.replicas, self.idle_since = current, now
        return now - self.idle_since

    def remember(self, recommendation: Recommendation, window_s: float) -> None:
        """Keep the recommendations the stabilization window still looks at, and this one."""
        since = recommendation.at - window_s
        self.history = [r for r in self.history if r.at >= since] + [recommendation]


class Autoscaler:
    """Scales ModelDeployments in ``namespaces`` (every namespace when empty) every interval."""

    def __init__(
        self,
        api: KubeApi,
        settings: AutoscalerSettings,
        namespaces: Sequence[str] = (),
        *,
        plan: PlanSettings | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.namespaces = list(namespaces)
        self.plan = plan or PlanSettings()
        """Where the orchestrator Service is, whose pods report the requests they hold."""
        self.scraper = httpx.AsyncClient(timeout=settings.scrape_timeout_s)
        self._memory: dict[tuple[str, str, PoolName], _Memory] = {}
        self._at_zero: set[tuple[str, str]] = set()
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
        next_round = 0.0
        while True:
            if time.monotonic() >= next_round:
                next_round = time.monotonic() + self.settings.interval_s
                await self.run_once()
            else:
                await self.wake_zero_pools()
            await asyncio.sleep(max(0.0, min(self.settings.demand_interval_s, next_round - time.monotonic())))

    async def wake_zero_pools(self) -> None:
        """Between rounds: decide at once for each ModelDeployment left at zero whose gateways hold
        requests for it (a round of its own, as ``run_once`` would run it)."""
        for key in sorted(self._at_zero):
            try:
                body = await self.api.get(API_VERSION, PLURAL, *key)
                if body is None or not await self._is_wanted_at_zero(body):
                    continue
                await self._visit(body, key, is_enabled=True)
            except (KubeError, httpx.HTTPError) as error:
                _log.warning(f"autoscaler: {key[0]}/{key[1]}: {error}; retrying")

    async def _is_wanted_at_zero(self, body: Object) -> bool:
        """Whether a ModelDeployment still at zero, still scaling to zero, has requests held for it."""
        try:
            md = ModelDeployment.from_object(body)
        except ValidationError:
            return False
        spec = md.spec
        if not spec.autoscaling.scales_to_zero or spec.pools()[spec.serving_pool].replicas != 0:
            return False
        return await self._held(md) > 0

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
        self._memory = {key: memory for key, memory in self._memory.items() if key[:2] in seen}
        self._at_zero &= seen

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
        items: list[Object] = []
        namespaces: list[str | None] = [*self.namespaces] or [None]  # None: every namespace
        for namespace in namespaces:
            response = await self.api.http.get(resource_path(API_VERSION, PLURAL, namespace))
            response.raise_for_status()
            items += response.json()["items"]
        return items

    async def _scale(self, body: Object, key: tuple[str, str]) -> None:
        try:
            md = ModelDeployment.from_object(body)
        except ValidationError:
            return  # the reconcile reports an invalid spec in the status; nothing to scale
        previous = (body.get("status") or {}).get("autoscaling") or {}
        status: Object = {}
        for pool in autoscaled_pools(md.spec):
            # The serving pool's decision is the top level of the status; another pool's is a key.
            if is_serving := pool == md.spec.serving_pool:
                status.update(await self._scale_pool(md, body, pool, previous, is_serving=is_serving))
            else:
                before = previous.get(pool) or {}
                status[pool] = await self._scale_pool(md, body, pool, before, is_serving=is_serving)
        await self._record(body, status)

    async def _scale_pool(
        self, md: ModelDeployment, body: Object, pool: PoolName, previous: Object, *, is_serving: bool
    ) -> Object:
        """Decide and apply one pool's size; returns its status (``previous`` is its last one)."""
        now = time.time()
        memory = self._memory.setdefault(
            (md.metadata.namespace, md.metadata.name, pool), _Memory(started=now)
        )
        current = md.spec.pools()[pool].replicas
        observed, num_ready = await self._observe(md, pool, memory)
        if is_serving and md.spec.autoscaling.scales_to_zero:
            observed = dataclasses.replace(observed, num_held=await self._held(md))
        last_scale_time = previous.get("lastScaleTime")
        last_scale = max(memory.started, _epoch(last_scale_time))
        idle_s = memory.idle_seconds(now, current, observed.is_idle)
        state = ScaleState(current, num_ready, now, now - last_scale, tuple(memory.history), idle_s)
        decision = decide(state, observed, pool_bounds(md.spec.autoscaling, pool), self.settings)
        memory.remember(Recommendation(now, decision.recommendation), self.settings.stabilization_s)
        if decision.desired != current:
            await self._apply(body, pool, current, decision, is_serving=is_serving)
            last_scale_time = _timestamp(now)
        if is_serving:
            key = (md.metadata.namespace, md.metadata.name)
            (self._at_zero.add if decision.desired == 0 else self._at_zero.discard)(key)
        return _pool_status(decision, observed, last_scale_time)

    async def _observe(self, md: ModelDeployment, pool: PoolName, memory: _Memory) -> tuple[Observation, int]:
        selector = selector_string(pool_labels(md.metadata.name, pool))
        pods = await self.api.list("v1", "pods", md.metadata.namespace, selector)
        ready = [pod for pod in pods if is_pod_ready(pod)]
        urls = {pod["metadata"]["name"]: metrics_url(pod) for pod in ready}
        scrapes = await scrape_all(self.scraper, urls, parse_scrape)
        observed = observe(memory.scrapes, scrapes)
        memory.scrapes = {pod: scrape for pod, scrape in scrapes.items() if scrape is not None}
        return observed, len(ready)

    async def _held(self, md: ModelDeployment) -> float:
        """The requests every orchestrator pod holds for the model (0 when none can be read)."""
        namespace = self.plan.orchestrator_namespace or md.metadata.namespace
        service = await self.api.get("v1", "services", namespace, self.plan.orchestrator_service)
        selector = ((service or {}).get("spec") or {}).get("selector")
        if not selector:
            return 0.0
        pods = await self.api.list("v1", "pods", namespace, selector_string(selector))
        urls = {pod["metadata"]["name"]: metrics_url(pod) for pod in pods if is_pod_ready(pod)}
        demands = await scrape_all(self.scraper, urls, parse_demand)
        held = (found.get(md.served_name, ModelDemand()) for found in demands.values() if found)
        return sum(demand.num_held for demand in held)

    async def _apply(
        self, body: Object, pool: PoolName, current: int, decision: Decision, *, is_serving: bool
    ) -> None:
        """Write the pool's new size: the scale subresource for the serving pool, else the pool's
        own ``replicas`` in the spec."""
        meta = body["metadata"]
        path = resource_path(API_VERSION, PLURAL, meta["namespace"], meta["name"])
        patch: Object
        if is_serving:
            path, patch = path + "/scale", {"spec": {"replicas": decision.desired}}
        else:
            patch = {"spec": {pool: {"replicas": decision.desired}}}
        response = await self.api.http.patch(path, json=patch, headers=_MERGE_PATCH)
        response.raise_for_status()
        verb = "ScaledUp" if decision.desired > current else "ScaledDown"
        message = f"{pool} replicas {current} -> {decision.desired}: {decision.reason}"
        _log.info(f"autoscaler: {meta['namespace']}/{meta['name']} {message}")
        await self.api.create("v1", "events", _event(body, verb, message))

    async def _record(self, body: Object, status: Object) -> None:
        patch = merge_patch_between((body.get("status") or {}).get("autoscaling") or {}, status)
        if patch:
            meta = body["metadata"]
            await self.api.patch_status(
                API_VERSION, PLURAL, meta["namespace"], meta["name"], {"autoscaling": patch}
            )


def merge_patch_between(old: Object, new: Object) -> Object:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: fields gone from ``new``
    become nulls, so a figure no longer observed, or a pool no longer scaled, leaves the status."""
    patch: Object = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            if nested := merge_patch_between(before, value):
                patch[key] = nested
        elif value != before:
            patch[key] = value
    return patch


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


def _pool_status(decision: Decision, observed: Observation, last_scale_time: str | None) -> Object:
    figures = {
        "ttftP95Ms": observed.ttft_p95_ms,
        "itlP95Ms": observed.itl_p95_ms,
        "numRequestsWaiting": observed.num_waiting,
        "numRequestsHeld": observed.num_held or None,
        "kvCacheUsage": observed.kv_usage,
    }
    status = {
        "desiredReplicas": decision.desired,
        "lastScaleTime": last_scale_time,
        "reason": decision.reason,
        "observed": _present(figures),
    }
    return _present(status)  # a figure not observed is left out, so the status diff removes it


def _present(fields: Object) -> Object:
    return {key: value for key, value in fields.items() if value is not None}


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime(_TIME_FORMAT)


def _epoch(timestamp: str | None) -> float:
    if not timestamp:
        return 0.0
    return datetime.strptime(timestamp, _TIME_FORMAT).replace(tzinfo=UTC).timestamp()
