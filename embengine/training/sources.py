"""Data sources of the training job: what to train on, batch by batch, reproducibly."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..data.dataset import ClickBatch, FeatureSpec

__all__ = ["DataSource", "MovieLensSource", "SyntheticSource", "DATASETS", "make_source"]

TEST_CHUNK = 4096


class DataSource:
    name: str
    features: list[FeatureSpec]
    n_dense: int
    examples_per_epoch: int
    oracle_auc: float | None = None

    def train_batches(self, batch_size: int, epoch: int, start: int = 0) -> Iterator[ClickBatch]:
        """Batches of one epoch, from batch index ``start`` (for resuming mid-epoch)."""
        raise NotImplementedError

    def batches_per_epoch(self, batch_size: int) -> int:
        raise NotImplementedError

    def test_batches(self, batch_size: int) -> Iterator[ClickBatch]:
        raise NotImplementedError

    def valid_batches(self, batch_size: int) -> Iterator[ClickBatch]:
        """Held-out batches (neither train nor test) that choose the reported epoch."""
        raise NotImplementedError


class MovieLensSource(DataSource):
    """MovieLens-100K: one epoch is the training split, reshuffled with the epoch as seed. The
    validation set is, per user, the latest VALID_FRACTION of the interactions before the test."""

    name = "movielens-100k"
    VALID_FRACTION = 0.05

    def __init__(self, raw_ids: bool = False):
        from ..data.movielens import load_movielens_100k

        data = load_movielens_100k(valid_fraction=self.VALID_FRACTION, raw_ids=raw_ids)
        self._train, self._test, self._valid = data.train, data.test, data.valid
        self.features = data.features
        self.n_dense = 0
        self.examples_per_epoch = len(self._train)

    def batches_per_epoch(self, batch_size):
        return math.ceil(len(self._train) / batch_size)

    def train_batches(self, batch_size, epoch, start=0):
        for i, batch in enumerate(self._train.batches(batch_size, shuffle=True, seed=epoch)):
            if i >= start:
                yield batch

    def test_batches(self, batch_size):
        return self._test.batches(batch_size)

    def valid_batches(self, batch_size):
        return self._valid.batches(batch_size)


@dataclass
class SyntheticSource(DataSource):
    """The synthetic Criteo-like stream; an epoch is ``examples_per_epoch`` fresh examples."""

    examples_per_epoch: int = 1_000_000
    test_examples: int = 100_000
    vocabulary_scale: float = 1.0
    seed: int = 0

    def __post_init__(self):
        from ..data.synthetic import DEFAULT_VOCABULARIES, SyntheticClicks

        vocab = tuple(max(1, int(v * self.vocabulary_scale)) for v in DEFAULT_VOCABULARIES)
        self.data = SyntheticClicks(vocab, seed=self.seed)
        self.name = "synthetic"
        self.features = self.data.features
        self.n_dense = self.data.n_dense
        self._oracle: float | None = None

    def batches_per_epoch(self, batch_size: int) -> int:
        return max(1, self.examples_per_epoch // batch_size)

    def train_batches(self, batch_size, epoch, start=0):
        n = self.batches_per_epoch(batch_size)
        first = epoch * n
        for i in range(start, n):
            yield self.data.batch(first + i, batch_size, "train")

    def test_batches(self, batch_size):
        """The test set: ``test_examples`` examples in chunks of TEST_CHUNK, whatever the
        training batch size, so its AUC compares across runs."""
        labels, probs = [], []
        for i, lo in enumerate(range(0, self.test_examples, TEST_CHUNK)):
            size = min(TEST_CHUNK, self.test_examples - lo)
            batch, p = self.data.batch_with_probabilities(i, size, "test")
            labels.append(batch.labels)
            probs.append(p)
            yield batch
        if self._oracle is None:
            from .metrics import auc

            self._oracle = auc(np.concatenate(labels), np.concatenate(probs))

    def valid_batches(self, batch_size):
        """``test_examples`` examples of the validation stream, in chunks of TEST_CHUNK."""
        for i, lo in enumerate(range(0, self.test_examples, TEST_CHUNK)):
            yield self.data.batch(i, min(TEST_CHUNK, self.test_examples - lo), "valid")

    @property
    def oracle_auc(self) -> float | None:
        """AUC of the hidden model's own probabilities on the test stream (the best possible)."""
        return self._oracle


DATASETS = ("movielens-100k", "synthetic")


def make_source(name: str, raw_ids: bool = False, **kwargs) -> DataSource:
    """The dataset ``name``; ``raw_ids``: MovieLens ids as in its files, other tokens hashed to
    64 bits (for keyed tables; the synthetic ids are raw already)."""
    if name == "movielens-100k":
        return MovieLensSource(raw_ids)
    if name == "synthetic":
        return SyntheticSource(**kwargs)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
