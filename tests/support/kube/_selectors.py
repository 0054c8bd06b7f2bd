"""Label and field selectors in the API server's string syntax.

Labels: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x,y)``, ``a`` (exists), ``!a`` (absent),
comma-joined (all must hold). Fields: ``path=value``, ``path==value``, ``path!=value`` on dotted paths
such as ``metadata.name`` or ``status.phase``; any path is accepted (the real server restricts them per type).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import bad_request

__all__ = ["Selector", "field_value", "parse_field_selector", "parse_label_selector", "selector_to_string"]

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\((.*)\)\s*$")
_EQ_RE = re.compile(r"^\s*([^\s!=]+)\s*(==|=|!=)\s*([^\s=!(),]*)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")

Requirement = Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True)
class Selector:
    """All requirements must hold; an empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, values: Mapping[str, Any]) -> bool:
        return all(requirement(values) for requirement in self.requirements)


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside ``( )`` value sets."""
    terms, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term for term in terms if term.strip()]


def _parse_label_term(term: str) -> Requirement:
    if match := _SET_RE.match(term):
        key, op, raw = match.groups()
        values = {value.strip() for value in raw.split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_RE.match(term):
        key, op, value = match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS_RE.match(term):
        negated, key = match.groups()
        return lambda labels: (key in labels) != bool(negated)
    raise bad_request(
        f"unable to parse requirement {term!r} in the label selector: use a=b, a!=b, a in (x,y)"
    )


def parse_label_selector(text: str | None) -> Selector:
    return Selector(tuple(_parse_label_term(term) for term in _split_terms(text or "")))


def field_value(obj: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path (``status.phase``), or None where any step is missing."""
    value: Any = obj
    for step in path.strip(".").split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(step)
    return value


def _parse_field_term(term: str) -> Requirement:
    match = _EQ_RE.match(term)
    if match is None:
        raise bad_request(f"invalid field selector term {term!r}: use path=value or path!=value")
    path, op, value = match.groups()

    def holds(obj: Mapping[str, Any]) -> bool:
        found = field_value(obj, path)
        actual = "" if found is None else str(found)
        return (actual == value) != (op == "!=")

    return holds


def parse_field_selector(text: str | None) -> Selector:
    return Selector(tuple(_parse_field_term(term) for term in _split_terms(text or "")))


def _expression_to_string(expression: Mapping[str, Any]) -> str:
    key, op = str(expression["key"]), expression["operator"]
    values = ",".join(expression.get("values", ()))
    forms = {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key}
    return forms.get(op, f"!{key}")


def selector_to_string(selector: Mapping[str, Any]) -> str:
    """A ``LabelSelector`` object (matchLabels, matchExpressions) in string syntax."""
    terms = [f"{key}={value}" for key, value in sorted(selector.get("matchLabels", {}).items())]
    terms += [_expression_to_string(expression) for expression in selector.get("matchExpressions", ())]
    return ",".join(terms)
