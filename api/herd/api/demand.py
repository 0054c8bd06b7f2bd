"""The orchestrator's demand signal, as the scalers read it from its ``/metrics``.

A model scaled to zero has no worker to report that requests wait, so the gateway that holds them
reports them: ``herd_router_requests_held{model}``. The operator's autoscaler and ``herd up`` scrape
every orchestrator's ``/metrics`` (an open path) and add the figures up, so any number of gateway
replicas give one demand per model. In-flight requests and the count of answered ones tell ``herd up``
when a model was last used.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from herd.api import metrics as names

__all__ = ["ModelDemand", "parse_demand"]


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model's requests at the orchestrators: held for a worker, in flight (held ones included),
    and answered so far (a counter: when it moves, the model was used)."""

    num_held: float = 0.0
    num_in_flight: float = 0.0
    num_answered: float = 0.0

    def __add__(self, other: ModelDemand) -> ModelDemand:
        return ModelDemand(
            self.num_held + other.num_held,
            self.num_in_flight + other.num_in_flight,
            self.num_answered + other.num_answered,
        )


_FIELDS = {
    names.HERD_ROUTER_REQUESTS_HELD: "num_held",
    names.HERD_ROUTER_IN_FLIGHT: "num_in_flight",
    names.HERD_ROUTER_REQUESTS_TOTAL.removesuffix("_total"): "num_answered",
}


def parse_demand(text: str) -> dict[str, ModelDemand]:
    """Each model's demand in one orchestrator's Prometheus text (a model it never saw is absent)."""
    figures: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field = _FIELDS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if "model" not in sample.labels:
                continue
            model = figures.setdefault(sample.labels["model"], {})
            model[field] = model.get(field, 0.0) + sample.value
    return {model: ModelDemand(**fields) for model, fields in figures.items()}
