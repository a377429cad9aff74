"""A synthetic Criteo-like click log whose best achievable AUC is known.

26 categorical features draw Zipf-like ids (a discretised Pareto over ranks, scattered over the
vocabulary by a fixed bijection) from vocabularies of any size up to 10^8; 13 dense features are
standard normal. A hidden model makes the labels::

    logit = bias + sum_f scale_f * effect_f(id_f) + dense @ w,    click ~ Bernoulli(sigmoid(logit))

where ``effect_f(id)`` is uniform in [-1, 1), a pure function of (seed, feature, id), so nothing
vocabulary-sized is ever held in memory. Batches are generated one at a time. The AUC of the
true probabilities on the test stream (``oracle_auc``) is the best any model can reach.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..initializers import table_key
from ..inputs import Ragged
from ..kernels.init import fill_uniform
from .dataset import ClickBatch, FeatureSpec

__all__ = ["SyntheticClicks", "DEFAULT_VOCABULARIES"]

# Criteo-like spread of cardinalities: a few huge, many small.
DEFAULT_VOCABULARIES = (
    1_000, 500, 100_000, 50_000, 300, 20, 10_000, 600, 3, 50_000, 5_000, 100_000, 3_000, 25,
    10_000, 100_000, 10, 4_000, 2_000, 4, 100_000, 15, 15, 50_000, 80, 40_000,
)  # fmt: skip


STREAMS = ("train", "test", "valid")  # independent streams of one hidden model


class SyntheticClicks:
    def __init__(
        self,
        vocabulary_sizes: tuple[int, ...] = DEFAULT_VOCABULARIES,
        n_dense: int = 13,
        zipf: float = 1.1,
        seed: int = 0,
    ):
        if len(vocabulary_sizes) < 1 or min(vocabulary_sizes) < 1:
            raise ValueError(f"vocabulary sizes must be >= 1, got {vocabulary_sizes}")
        if max(vocabulary_sizes) > 10**8:
            raise ValueError(
                f"vocabulary sizes up to 10^8 are supported, got {max(vocabulary_sizes)}"
            )
        if not zipf > 1.0:
            raise ValueError(f"zipf exponent must be > 1, got {zipf}")
        self.vocabulary_sizes = tuple(int(v) for v in vocabulary_sizes)
        self.n_dense = n_dense
        self.zipf = zipf
        self.seed = seed
        self.features = [FeatureSpec(f"C{i + 1}", v) for i, v in enumerate(self.vocabulary_sizes)]
        rng = np.random.default_rng([seed, 7])
        # Larger vocabularies carry less signal per id; the total logit std is about 1.5.
        raw = np.array([1.0 / (1.0 + math.log10(v)) for v in self.vocabulary_sizes])
        self.scales = 2.2 * raw / np.sqrt(np.sum(raw**2 / 3.0))
        self.dense_weights = rng.normal(0.0, 0.5 / max(1, n_dense) ** 0.5, n_dense)
        self.bias = -1.0
        self._multipliers = [
            self._coprime(v, 2654435761 + 2 * i) for i, v in enumerate(self.vocabulary_sizes)
        ]

    @staticmethod
    def _coprime(n: int, start: int) -> int:
        a = start % n if n > 1 else 0
        while n > 1 and math.gcd(a, n) != 1:
            a += 1
        return a

    def _ids(self, rng: np.random.Generator, f: int, size: int) -> np.ndarray:
        v = self.vocabulary_sizes[f]
        lo = v ** (1.0 - self.zipf)  # P(rank > v) of the Pareto
        u = lo + (1.0 - lo) * rng.random(size)
        ranks = np.minimum(np.floor(u ** (-1.0 / (self.zipf - 1.0))), v).astype(np.int64) - 1
        return (ranks * self._multipliers[f]) % v  # a bijection of [0, v)

    def effects(self, f: int, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), 1), dtype=np.float32)
        key = table_key(self.seed, f"synthetic/{self.features[f].name}")
        fill_uniform(out, np.ascontiguousarray(ids, dtype=np.int64), key, -1.0, 1.0)
        return out[:, 0].astype(np.float64)

    def _batch(self, rng: np.random.Generator, size: int) -> tuple[ClickBatch, np.ndarray]:
        dense = rng.standard_normal((size, self.n_dense)).astype(np.float32)
        logit = self.bias + dense.astype(np.float64) @ self.dense_weights
        sparse = {}
        for f, spec in enumerate(self.features):
            ids = self._ids(rng, f, size)
            logit += self.scales[f] * self.effects(f, ids)
            sparse[spec.name] = Ragged(ids, offsets=np.arange(size + 1, dtype=np.int64))
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(size) < prob).astype(np.float32)
        return ClickBatch(sparse, dense, labels), prob

    def batch(self, index: int, batch_size: int, stream: str = "train") -> ClickBatch:
        """Batch ``index`` of a stream: a pure function of (seed, stream, index, size), so a
        resumed run continues with exactly the batches it would have seen."""
        return self.batch_with_probabilities(index, batch_size, stream)[0]

    def batch_with_probabilities(self, index: int, batch_size: int, stream: str = "train"):
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {', '.join(STREAMS)}, got {stream!r}")
        rng = np.random.default_rng([self.seed, STREAMS.index(stream), index])
        return self._batch(rng, batch_size)

    def batches(
        self, batch_size: int, count: int, stream: str = "train", start: int = 0
    ) -> Iterator[ClickBatch]:
        for i in range(start, start + count):
            yield self.batch(i, batch_size, stream)
