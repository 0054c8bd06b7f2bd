"""A batch's input and output files, line by line: parsing, validation, the lines written back.

Pure: no I/O. An input file is JSON Lines, one request a line (``custom_id``, ``method: POST``,
``url`` equal to the batch's endpoint, ``body``); ``custom_id`` values are unique. The output file
gets one line per request answered 200, the error file one per request that failed, each naming
its ``custom_id``; ``done_ids`` reads them back, so a restarted gateway skips what is written.
"""

from __future__ import annotations

import io
import json
import secrets
from dataclasses import dataclass
from typing import Any

from herd.api.body import json_value

__all__ = [
    "BATCH_ENDPOINTS",
    "BatchLine",
    "InputError",
    "done_ids",
    "error_line",
    "output_line",
    "parse_input",
]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000
"""OpenAI's limit of requests per batch."""


class InputError(ValueError):
    """An input file a batch cannot run; ``line`` is 1-based (0: the file as a whole)."""

    def __init__(self, line: int, message: str, *, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.line = line
        self.code = code


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    body: bytes
    """The request body as JSON, ``stream`` forced off."""


def parse_input(content: bytes, endpoint: str) -> list[BatchLine]:
    """Every request of an input file; ``InputError`` names the first bad line. It stops at the first
    request past ``MAX_LINES``: the rest of a file that is too long is not worth parsing."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(io.BytesIO(content), start=1):  # one line at a time, not all as a list
        if not raw.strip():
            continue
        if len(lines) == MAX_LINES:
            raise InputError(
                number, f"line {number}: a batch takes at most {MAX_LINES} requests; split the input file"
            )
        line = _request(raw, number, endpoint)
        if line.custom_id in seen:
            raise InputError(
                number, f"line {number}: custom_id {line.custom_id!r} is used twice; make each unique"
            )
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise InputError(0, "the input file has no requests", code="empty_file")
    return lines


def _request(raw: bytes, number: int, endpoint: str) -> BatchLine:
    try:
        item = json_value(raw, what=f"line {number}")
    except ValueError as error:
        raise InputError(number, str(error)) from None
    if not isinstance(item, dict):
        raise InputError(number, f"line {number} is not a JSON object")
    custom_id, body = item.get("custom_id"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputError(number, f"line {number}: custom_id must be a non-empty string")
    if item.get("method") != "POST":
        raise InputError(number, f"line {number}: method must be POST")
    if item.get("url") != endpoint:
        raise InputError(
            number, f"line {number}: url must be the batch's endpoint {endpoint}", code="mismatched_url"
        )
    if not isinstance(body, dict):
        raise InputError(number, f"line {number}: body must be a JSON object (the request)")
    return BatchLine(custom_id, json.dumps({**body, "stream": False}).encode())


def output_line(custom_id: str, status: int, body: Any, request_id: str | None) -> bytes:
    response = {"status_code": status, "request_id": request_id or "", "body": body}
    return _line({"id": _line_id(), "custom_id": custom_id, "response": response, "error": None})


def error_line(custom_id: str, status: int | None, body: Any, message: str) -> bytes:
    response = None if status is None else {"status_code": status, "request_id": "", "body": body}
    error = {"code": "request_failed" if status is None else str(status), "message": message}
    return _line({"id": _line_id(), "custom_id": custom_id, "response": response, "error": error})


def done_ids(content: bytes) -> set[str]:
    """The ``custom_id`` of every complete line of an output or error file (a cut last line is not)."""
    done = set()
    for raw in content.split(b"\n")[:-1]:  # only lines that got their newline
        try:
            done.add(str(json.loads(raw)["custom_id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return done


def _line(item: dict[str, Any]) -> bytes:
    return json.dumps(item, separators=(",", ":")).encode() + b"\n"


def _line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"
