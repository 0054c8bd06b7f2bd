"""N-gram prompt lookup: which tokens it proposes, table-driven."""

from __future__ import annotations

import pytest

from herd.worker.speculative.ngram import propose_ngram


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "expected"),
    [
        pytest.param([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3, [4, 5, 1], id="trigram-continues"),
        pytest.param([1, 2, 3, 4, 5, 1, 2], 5, 2, 3, [3, 4, 5, 1, 2], id="runs-to-the-end"),
        pytest.param([1, 2, 3, 9, 1, 2, 3, 8, 2, 3], 2, 2, 2, [8, 2], id="latest-match-wins"),
        pytest.param([5, 1, 2, 6, 9, 1, 2], 2, 2, 3, [6, 9], id="longest-n-first"),
        pytest.param([7, 2, 5, 1, 2], 2, 2, 4, [], id="below-min-n"),
        pytest.param([7, 2, 5, 1, 2], 2, 1, 4, [5, 1], id="unigram-allowed"),
        pytest.param([1, 2, 3], 5, 1, 3, [], id="no-repeat"),
        pytest.param([1, 2, 3, 1, 2], 0, 1, 3, [], id="no-slots"),
        pytest.param([256, 1, 2, 256], 3, 1, 2, [1, 2, 256], id="byte-unaligned-ids"),
        pytest.param([256, 0, 7, 1], 2, 1, 1, [], id="bytes-of-1-inside-256-0-are-no-match"),
    ],
)
def test_proposes(tokens: list[int], k: int, min_n: int, max_n: int, expected: list[int]) -> None:
    assert propose_ngram(tokens, k, min_n=min_n, max_n=max_n) == expected
