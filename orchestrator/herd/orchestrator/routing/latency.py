"""Each worker's time to first token and time per output token, predicted from what it served.

A request's TTFT on a worker is mostly the prefill work ahead of it plus its own: ``LatencyModel``
fits, per worker, ``ttft ~ a + b * queued_prefill_tokens + c * batch + d * uncached_prompt_tokens``
and ``tpot ~ e + f * batch + g * queued_prefill_tokens`` (chunked prefill shares each step with the
decodes) by least squares over what the gateway saw that worker do, each sample's weight decaying by
``decay`` per newer one so a worker that slows down is followed. Until a worker has ``min_samples``
of its own, the fit over every worker of the model stands in for it. The features are those of the
moment of choice (``LatencyFeatures``), observed against the latency the request then had.

A worker's TTFT slopes on prefill tokens (queued and its own) start from its reported prefill rate
(``ttft_prior``): the fit is pulled towards ``1 / rate`` seconds a token with the weight of
``prior_weight`` samples of a 1,000-token feature, so a worker whose few samples rarely had a long
prompt queued is not predicted to do queued prefill for free until its slow first tokens come back;
samples enough outweigh the prior where the worker does differ from it.

Pure and synchronous: ``decide`` predicts with it, the gateway feeds it. Cost per prediction: a
dot product; per observation, one rank-one update of a 4x4 system (solved again on the next predict,
or when the prior changed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LatencyFeatures", "LatencyModel", "OnlineRegression", "Prediction", "ttft_prior"]

_TOKENS_SCALE = 1000.0
"""Token counts enter the fit in thousands, so every coefficient has a similar size."""


@dataclass(frozen=True, slots=True)
class LatencyFeatures:
    """A worker's state when a request was sent to it, and the request's uncached prompt."""

    queued_prefill_tokens: int
    batch: int
    uncached_prompt_tokens: int

    def ttft_row(self) -> tuple[float, ...]:
        return (
            1.0,
            self.queued_prefill_tokens / _TOKENS_SCALE,
            float(self.batch),
            self.uncached_prompt_tokens / _TOKENS_SCALE,
        )

    def tpot_row(self) -> tuple[float, ...]:
        return (1.0, float(self.batch), self.queued_prefill_tokens / _TOKENS_SCALE)


def ttft_prior(prefill_tokens_per_s: float | None) -> dict[int, float]:
    """The TTFT row's coefficients a worker prefilling ``prefill_tokens_per_s`` has a priori: its
    queued prefill tokens and the prompt's own each cost ``1 / rate`` (per 1,000 tokens, as the row
    has them); none while the rate is unmeasured."""
    if not prefill_tokens_per_s or prefill_tokens_per_s <= 0.0:
        return {}
    seconds_per_unit = _TOKENS_SCALE / prefill_tokens_per_s
    return {1: seconds_per_unit, 3: seconds_per_unit}


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_seconds: float
    tpot_seconds: float


class OnlineRegression:
    """Exponentially weighted ridge least squares, kept as its normal equations.

    ``predict`` may pull some coefficients towards prior values (``prior``: feature index to value),
    each with the weight of ``prior_weight`` samples whose feature is 1 (a Gaussian prior on them).
    """

    def __init__(
        self, num_features: int, *, decay: float = 0.99, ridge: float = 1e-6, prior_weight: float = 0.0
    ) -> None:
        self.num_features = num_features
        self.decay = decay
        self.ridge = ridge
        self.prior_weight = prior_weight
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features
        self.num_samples = 0
        self._coefficients: list[float] | None = None
        self._coefficients_prior: tuple[tuple[int, float], ...] = ()

    def observe(self, row: Sequence[float], value: float) -> None:
        decay = self.decay
        for i in range(self.num_features):
            self._xty[i] = self._xty[i] * decay + row[i] * value
            line = self._xtx[i]
            for j in range(self.num_features):
                line[j] = line[j] * decay + row[i] * row[j]
        self.num_samples += 1
        self._coefficients = None

    def predict(self, row: Sequence[float], prior: Mapping[int, float] | None = None) -> float:
        pulled = tuple(sorted(prior.items())) if prior and self.prior_weight > 0.0 else ()
        if self._coefficients is None or pulled != self._coefficients_prior:
            self._coefficients = _solve(self._xtx, self._xty, self.ridge, pulled, self.prior_weight)
            self._coefficients_prior = pulled
        return sum(c * x for c, x in zip(self._coefficients, row, strict=True))


@dataclass(eq=False)
class _Fits:
    ttft: OnlineRegression
    tpot: OnlineRegression

    @classmethod
    def new(cls, decay: float, prior_weight: float) -> _Fits:
        return cls(
            OnlineRegression(4, decay=decay, prior_weight=prior_weight), OnlineRegression(3, decay=decay)
        )


class LatencyModel:
    """One served model's latency fits: one per worker, and one over all of them."""

    def __init__(self, *, min_samples: int = 8, decay: float = 0.99, prior_weight: float = 16.0) -> None:
        self.min_samples = min_samples
        self.decay = decay
        self.prior_weight = prior_weight
        self._pooled = _Fits.new(decay, prior_weight)
        self._workers: dict[str, _Fits] = {}

    def predict(
        self, worker_id: str, features: LatencyFeatures, prefill_tokens_per_s: float | None = None
    ) -> Prediction | None:
        """``None`` while not even the pooled fits have ``min_samples`` of each latency.
        ``prefill_tokens_per_s``: the worker's reported prefill rate, the TTFT slopes' prior."""
        ttft = self._fit(worker_id, "ttft")
        tpot = self._fit(worker_id, "tpot")
        if ttft is None or tpot is None:
            return None
        return Prediction(
            max(ttft.predict(features.ttft_row(), ttft_prior(prefill_tokens_per_s)), 0.0),
            max(tpot.predict(features.tpot_row()), 0.0),
        )

    def observe_ttft(self, worker_id: str, features: LatencyFeatures, seconds: float) -> None:
        for fits in (self._pooled, self._of(worker_id)):
            fits.ttft.observe(features.ttft_row(), seconds)

    def observe_tpot(self, worker_id: str, features: LatencyFeatures, seconds: float) -> None:
        for fits in (self._pooled, self._of(worker_id)):
            fits.tpot.observe(features.tpot_row(), seconds)

    def num_samples(self, worker_id: str) -> tuple[int, int]:
        """The TTFT and TPOT samples of the worker's own fits."""
        fits = self._workers.get(worker_id)
        return (0, 0) if fits is None else (fits.ttft.num_samples, fits.tpot.num_samples)

    def forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def _of(self, worker_id: str) -> _Fits:
        fits = self._workers.get(worker_id)
        if fits is None:
            fits = self._workers[worker_id] = _Fits.new(self.decay, self.prior_weight)
        return fits

    def _fit(self, worker_id: str, kind: str) -> OnlineRegression | None:
        own = self._workers.get(worker_id)
        for fits in (own, self._pooled):
            if fits is not None:
                fit: OnlineRegression = getattr(fits, kind)
                if fit.num_samples >= self.min_samples:
                    return fit
        return None


def _solve(
    matrix: list[list[float]],
    vector: list[float],
    ridge: float,
    prior: Sequence[tuple[int, float]] = (),
    prior_weight: float = 0.0,
) -> list[float]:
    """``(A + ridge * I + w * P) x = b + w * P x0`` by Gaussian elimination with partial pivoting (A is
    small), where ``P`` selects the coefficients ``prior`` names and ``x0`` holds their values."""
    size = len(vector)
    rows = [[*matrix[i], vector[i]] for i in range(size)]
    for i in range(size):
        rows[i][i] += ridge * max(1.0, rows[i][i])
    for i, value in prior:
        rows[i][i] += prior_weight
        rows[i][size] += prior_weight * value
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        rows[column], rows[pivot] = rows[pivot], rows[column]
        if abs(rows[column][column]) < 1e-12:
            continue  # a feature that never varied: its coefficient stays 0
        for r in range(size):
            if r != column:
                factor = rows[r][column] / rows[column][column]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[column], strict=True)]
    return [rows[i][size] / rows[i][i] if abs(rows[i][i]) >= 1e-12 else 0.0 for i in range(size)]
