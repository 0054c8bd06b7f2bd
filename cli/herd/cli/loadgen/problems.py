"""Pydantic's validation problems as ``herd bench`` words them: one line each, never the input (a trace
or a server's answer may hold a key), pydantic's ``Value error, `` prefix dropped."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails

__all__ = ["first_problem", "problem_message"]


def problem_message(problem: ErrorDetails) -> str:
    """What is wrong, without where."""
    if problem["type"] in {"model_type", "dict_type"}:
        return "not a JSON object"
    return problem["msg"].removeprefix("Value error, ")


def first_problem(error: ValidationError) -> str:
    """The first problem, as ``where: what`` (dotted field path), or ``what`` for the whole value."""
    problem = error.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(part) for part in problem["loc"])
    message = problem_message(problem)
    return f"{where}: {message}" if where else message
