"""``spec.engine.speculative``: what the schema takes and what it refuses, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from herd.api.crd import EngineSpec, ModelDeploymentSpec


def engine(**speculative: Any) -> EngineSpec:
    return EngineSpec.model_validate({"speculative": speculative})


def test_defaults() -> None:
    spec = engine(method="ngram").speculative
    assert spec is not None
    assert (spec.num_tokens, spec.adaptive, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, True, 2, 4)
    assert EngineSpec().speculative is None


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        pytest.param({"method": "draft"}, "method draft needs draftModel", id="draft-without-model"),
        pytest.param(
            {"method": "ngram", "draftModel": "file:///m"},
            "applies to method draft only",
            id="ngram-with-model",
        ),
        pytest.param({"method": "draft", "draftModel": "/m"}, "no known scheme", id="draft-model-scheme"),
        pytest.param({"method": "eagle"}, "method", id="unknown-method"),
        pytest.param({"method": "ngram", "numTokens": 0}, "numTokens", id="no-tokens"),
        pytest.param({"method": "ngram", "numTokens": 17}, "numTokens", id="too-many-tokens"),
        pytest.param(
            {"method": "ngram", "promptLookupMin": 5, "promptLookupMax": 3},
            "promptLookupMin",
            id="min-over-max",
        ),
        pytest.param({"method": "ngram", "k": 3}, "k", id="unknown-key"),
    ],
)
def test_refusals_name_the_field(speculative: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        engine(**speculative)


def test_the_simulated_backend_refuses_a_draft_model() -> None:
    with pytest.raises(ValidationError, match="simulated backend has none"):
        EngineSpec.model_validate(
            {"backend": "simulated", "speculative": {"method": "draft", "draftModel": "file:///d"}}
        )
    assert EngineSpec.model_validate({"backend": "simulated", "speculative": {"method": "ngram"}}).speculative


def test_a_disaggregated_model_refuses_a_draft_model() -> None:
    pool = {"replicas": 1}
    body = {
        "model": {"source": "hf://Org/M"},
        "serving": {"mode": "disaggregated"},
        "prefill": pool,
        "decode": pool,
        "engine": {"speculative": {"method": "draft", "draftModel": "hf://Org/Small"}},
    }
    with pytest.raises(ValidationError, match="serves aggregated only"):
        ModelDeploymentSpec.model_validate(body)
    body["engine"] = {"speculative": {"method": "ngram"}}
    assert ModelDeploymentSpec.model_validate(body).engine.speculative is not None


def test_an_embedding_model_refuses_speculation() -> None:
    with pytest.raises(ValidationError, match=r"engine\.speculative applies to generation"):
        EngineSpec.model_validate({"task": "embed", "speculative": {"method": "ngram"}})
