"""Varied JSON schemas, generated from a seed, for structured-output tests (issue 15).

Every schema is closed (``additionalProperties: false``) and every string, array and number is
bounded, as OpenAI's strict mode asks of a schema, so that any model (a random-weight one included)
completes an output within a few hundred tokens.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["varied_schemas"]

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog"]


def varied_schemas(count: int, *, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, depth=0) for _ in range(count)]


def _object(rng: random.Random, *, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value(rng, depth=depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value(rng: random.Random, *, depth: int) -> dict[str, Any]:
    kinds = ["string", "enum", "const", "integer", "number", "boolean", "null", "pattern", "nullable"]
    if depth < 3:
        kinds += ["array", "object", "anyOf"]
    match rng.choice(kinds):
        case "string":
            return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}
        case "enum":
            return {"enum": rng.sample([*_WORDS, 1, 2.5, True, None], rng.randint(1, 4))}
        case "const":
            return {"const": rng.choice(_WORDS)}
        case "integer":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
        case "number":
            return {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}
        case "boolean":
            return {"type": "boolean"}
        case "null":
            return {"type": "null"}
        case "pattern":
            return {
                "type": "string",
                "pattern": rng.choice(["^[a-z]{2,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"]),
            }
        case "nullable":
            return {"type": ["string", "null"], "maxLength": 5}
        case "array":
            return {
                "type": "array",
                "items": _value(rng, depth=depth + 1),
                "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3),
            }
        case "object":
            return _object(rng, depth=depth)
        case _:
            return {"anyOf": [_value(rng, depth=depth + 1), _value(rng, depth=depth + 1)]}
