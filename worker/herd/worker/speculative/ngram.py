"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last ``n`` tokens, for ``n`` from ``max_n`` down to ``min_n``.

Output that repeats its input (editing, summarizing, code changes, quoting) continues as it did
the last time the same few tokens appeared, so the proposal is often right and costs no model.
The search runs on the token ids packed into bytes (``bytes.rfind`` in C), so a step pays
microseconds per sequence even over thousands of tokens; a hit is kept only at a token boundary.
"""

from __future__ import annotations

from array import array

__all__ = ["propose_ngram"]

_ITEM = array("q").itemsize


def propose_ngram(token_ids: list[int], num_tokens: int, *, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` ids that followed the latest earlier match of the last ``n`` ids
    (longest ``n`` first); ``[]`` when no n-gram of ``min_n`` to ``max_n`` ids recurs."""
    if num_tokens < 1 or len(token_ids) < min_n + 1:
        return []
    packed = array("q", token_ids).tobytes()
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        start = _latest_match(packed, packed[-n * _ITEM :], len(packed) - n * _ITEM)
        if start is not None:
            follow = start + n
            return token_ids[follow : follow + num_tokens]
    return []


def _latest_match(packed: bytes, pattern: bytes, end: int) -> int | None:
    """The token index of the latest occurrence of ``pattern`` starting before byte ``end``
    (the suffix itself excluded), at a token boundary."""
    limit = end + len(pattern) - 1  # rfind searches [0, limit): a match must start before `end`
    while limit >= len(pattern):
        at = packed.rfind(pattern, 0, limit)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        limit = at + len(pattern) - 1
    return None
