"""Render the ModelDeployment CustomResourceDefinition from the pydantic models.

pydantic emits JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3.0 schema. The
conversion inlines ``$ref``s, drops ``null`` branches (optional means "may be absent"), folds the
routing discriminated union into one object whose ``strategy`` enum lists every variant (structural
schemas allow no ``oneOf`` of differing shapes; pydantic still enforces the per-strategy keys), turns
``const`` into a one-value enum and 2020-12 ``exclusiveMinimum`` into the 3.0 boolean form, and marks
free-form maps with ``x-kubernetes-preserve-unknown-fields``.

The cross-field rules pydantic enforces in validators become CEL ``x-kubernetes-validations``, so the
API server refuses what the operator would refuse, with the same sentence: pools that match the
serving mode, each engine block only with its backend (and vLLM only aggregated), the autoscaling
bounds, the model source's scheme, a power-of-two block size, the metadata name's length, and each
routing setting only with the strategy that reads it (derived from the union's variants). Per-field
bounds (``minimum``) and unknown keys (strict field validation) need no rule.
"""

from __future__ import annotations

from typing import Any

from herd.api.crd import (
    BACKEND_BLOCKS,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAME,
    SOURCE_SCHEMES,
    VERSION,
    VLLM_DISAGGREGATED,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    backend_block_message,
)

__all__ = ["crd_manifest", "openapi_schema"]

Schema = dict[str, Any]
_DROP = {"title", "discriminator", "$defs"}


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _resolve({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    return node


def _merge_variants(variants: list[Schema], discriminator: str | None = None) -> Schema:
    merged: Schema = {"type": "object", "properties": {}}
    required = set(variants[0].get("required", []))
    for variant in variants:
        required &= set(variant.get("required", []))
        for name, prop in variant.get("properties", {}).items():
            # No defaults inside a union: the API server would add one variant's keys to another.
            prop = {k: v for k, v in prop.items() if k != "default"}
            seen = merged["properties"].setdefault(name, prop)
            if "enum" in prop and seen is not prop:
                seen["enum"] = sorted(set(seen.get("enum", [])) | set(prop["enum"]))
    if required:
        merged["required"] = sorted(required)
    if discriminator is not None:
        rules = _variant_rules(variants, discriminator)
        if rules:
            merged["x-kubernetes-validations"] = rules
    return merged


def _variant_rules(variants: list[Schema], discriminator: str) -> list[Schema]:
    """One CEL rule per field that only some variants have: it may be set only with their tag."""
    owners: dict[str, list[str]] = {}
    for variant in variants:
        tag = variant["properties"][discriminator]["enum"][0]
        for name in variant["properties"]:
            owners.setdefault(name, []).append(tag)
    all_tags = len(variants)
    rules = []
    for name, tags in owners.items():
        if len(tags) == all_tags:
            continue
        listed = ", ".join(f"'{tag}'" for tag in tags)
        fix = f"set {discriminator}: {tags[0]}" if len(tags) == 1 else f"set {discriminator} to one of them"
        message = f"{name} applies only to {discriminator} {' or '.join(tags)}: remove it or {fix}"
        rules.append({"rule": f"!has(self.{name}) || self.{discriminator} in [{listed}]", "message": message})
    return rules


def _convert(node: Schema, defs: dict[str, Schema]) -> Schema:
    node = _resolve(node, defs)
    if "oneOf" in node:
        variants = [_convert(v, defs) for v in node["oneOf"]]
        extra = {k: v for k, v in node.items() if k in ("description", "default")}
        discriminator = node.get("discriminator", {}).get("propertyName")
        return {**_merge_variants(variants, discriminator), **extra}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(branches) == 1:
            return _convert({**branches[0], **rest}, defs)
        return {"x-kubernetes-int-or-string": True, **{k: v for k, v in rest.items() if k != "default"}}
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "const":
            out["enum"] = [value]
            out.setdefault("type", "string")
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            required = set(node.get("required", []))
            out[key] = {
                name: _with_empty_default(_convert(prop, defs), _resolve(prop, defs), name in required)
                for name, prop in value.items()
            }
        elif key == "items":
            out[key] = _convert(value, defs)
        elif key == "additionalProperties":
            # `false` is implied: the API server prunes unknown fields of a structural schema.
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _convert(value, defs)
        else:
            out[key] = value
    if out.get("type") == "array" and out.get("items") == {}:
        out["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    is_free_form = "properties" not in out and "additionalProperties" not in out
    if out.get("type") == "object" and is_free_form:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _with_empty_default(converted: Schema, raw: Schema, is_required: bool) -> Schema:
    """Give an optional object whose fields have defaults ``default: {}``.

    The API server applies a field's default only where its parent exists; ``{}`` on the parent
    makes a manifest without ``serving:`` come back with ``serving.mode: aggregated``, as pydantic
    reads it. Nullable objects (``prefill``, ``decode``) and unions (``routing``) are left alone:
    for them absence means something.
    """
    is_plain_object = converted.get("type") == "object" and "properties" in converted
    is_union_or_nullable = "oneOf" in raw or "anyOf" in raw
    has_defaults = any("default" in prop for prop in converted.get("properties", {}).values())
    if (
        is_required
        or not is_plain_object
        or is_union_or_nullable
        or "default" in converted
        or not has_defaults
    ):
        return converted
    return {**converted, "default": {}}


def openapi_schema(model: type[ModelDeploymentSpec] | type[ModelDeploymentStatus]) -> Schema:
    """A structural OpenAPI v3.0 schema for one of the resource's parts (spec: with its CEL rules)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _convert(raw, raw.get("$defs", {}))
    if model is ModelDeploymentSpec:
        for path, rules in _spec_rules().items():
            node = schema
            for name in path:
                node = node["properties"][name]
            node["x-kubernetes-validations"] = [*node.get("x-kubernetes-validations", []), *rules]
    return schema


def _rule(rule: str, message: str) -> Schema:
    return {"rule": rule, "message": message}


def _spec_rules() -> dict[tuple[str, ...], list[Schema]]:
    """The validators of herd.api.crd as CEL, by the path of the object they sit on (``()``: spec).

    Each rule tests ``has`` before reading a field with a default: the server fills defaults in before
    it validates an object, but it also checks each rule against a parent's ``default: {}`` as it is.
    """
    is_disaggregated = "has(self.serving) && has(self.serving.mode) && self.serving.mode == 'disaggregated'"
    schemes = ", ".join(f"'{scheme}'" for scheme in SOURCE_SCHEMES)
    sizes = ", ".join(str(2**power) for power in range(11))
    return {
        (): [
            _rule(
                f"!({is_disaggregated}) || (has(self.prefill) && has(self.decode))",
                "serving.mode disaggregated needs spec.prefill and spec.decode "
                "(a pool with replicas and resources)",
            ),
            _rule(
                f"({is_disaggregated}) || (!has(self.prefill) && !has(self.decode))",
                "spec.prefill and spec.decode are only used with serving.mode: disaggregated; "
                "remove them or set the mode",
            ),
            _rule(
                f"!({is_disaggregated}) || !has(self.engine) || !has(self.engine.backend) "
                "|| self.engine.backend != 'vllm'",
                VLLM_DISAGGREGATED,
            ),
        ],
        ("engine",): [
            _rule(
                f"!has(self.{block}) || (has(self.backend) && self.backend == '{backend}')",
                backend_block_message(block, backend),
            )
            for block, backend in BACKEND_BLOCKS.items()
        ],
        ("model",): [
            _rule(
                f"[{schemes}].exists(s, self.source.startsWith(s) && self.source.size() > s.size())",
                "model.source has no known scheme: use one of "
                + ", ".join(f"{scheme}..." for scheme in SOURCE_SCHEMES),
            )
        ],
        ("engine", "kvCache"): [
            _rule(
                f"!has(self.blockSize) || self.blockSize in [{sizes}]",
                "engine.kvCache.blockSize must be a power of two (16, 32, ...)",
            )
        ],
        ("autoscaling",): [
            _rule(
                "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                "autoscaling.minReplicas exceeds maxReplicas: raise maxReplicas or lower minReplicas",
            )
        ],
    }


def _root_rules() -> list[Schema]:
    """metadata.name: the only metadata CEL may read. The server checks a DNS subdomain; herd needs a
    label short enough for the pool suffixes, as ``ObjectMeta`` checks."""
    return [
        _rule(
            "self.metadata.name.size() <= 52 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
            "metadata.name must be a DNS label of at most 52 characters (lowercase letters, digits, '-'), "
            "since pool objects append a suffix",
        )
    ]


def _printer_columns() -> list[Schema]:
    def pool(name: str) -> Schema:
        return {
            "name": name.capitalize(),
            "type": "string",
            "jsonPath": f".status.pools.{name}.ready",
            "description": f"ready/desired replicas of the {name} pool",
        }

    return [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Mode", "type": "string", "jsonPath": ".spec.serving.mode"},
        pool("workers"),
        pool("prefill"),
        pool("decode"),
        {"name": "Strategy", "type": "string", "jsonPath": ".spec.routing.strategy"},
        {
            "name": "Endpoint",
            "type": "string",
            "jsonPath": ".status.endpoint",
            "description": "the OpenAI base URL that serves the model (as its servedName)",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> Schema:
    """The whole ``apiextensions.k8s.io/v1`` CustomResourceDefinition object."""
    status = openapi_schema(ModelDeploymentStatus)
    root: Schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(ModelDeploymentSpec),
            "status": status,
        },
        "x-kubernetes-validations": _root_rules(),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "herd"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": ["herd"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": _printer_columns(),
                }
            ],
        },
    }
