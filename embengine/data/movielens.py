"""MovieLens-100K as implicit-feedback CTR, from the copy that the PyPI package ``recbole`` ships.

Click = rating >= 4. Features: user id, item id, age, gender, occupation, zip prefix (first 2
characters), release year, genres (multi-valued, mean) and title words (multi-valued, sqrtn).
Split: for each user, the latest 20% of their interactions by timestamp (rounded, ties broken by
file order) form the test set; with ``valid_fraction`` > 0, the latest ``valid_fraction`` of the
rest (rounded) form a validation set, cut the same way, for choosing an epoch without the test.
Token 0 of every vocabulary means "missing".

With ``raw_ids=True`` nothing is remapped (for tables keyed by any int64, ``--vocabulary
dynamic``): user and item ids are the ids of the files, every other token is a 64-bit hash of
its feature name and text (BLAKE2b), and a missing value is key 0.

The files are found without importing recbole (which pulls heavy dependencies): install it with
``pip install --no-deps recbole``, or point ``EMBENGINE_ML100K_DIR`` at a folder holding
``ml-100k.inter``, ``ml-100k.user`` and ``ml-100k.item``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..inputs import Ragged
from .dataset import FeatureSpec, InMemoryClicks

__all__ = ["load_movielens_100k", "find_movielens_100k", "MovieLens"]

INSTALL_HINT = (
    "MovieLens-100K not found: install the package that ships it with "
    "`pip install --no-deps recbole` (make setup does), or set EMBENGINE_ML100K_DIR to a folder "
    "with ml-100k.inter, ml-100k.user and ml-100k.item"
)


def find_movielens_100k() -> Path:
    """The folder holding ml-100k.{inter,user,item}; FileNotFoundError saying how to get it."""
    env = os.environ.get("EMBENGINE_ML100K_DIR")
    candidates = [Path(env)] if env else []
    spec = importlib.util.find_spec("recbole")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / "dataset_example" / "ml-100k")
    for folder in candidates:
        if all((folder / f"ml-100k.{ext}").is_file() for ext in ("inter", "user", "item")):
            return folder
    raise FileNotFoundError(INSTALL_HINT)


def _read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, encoding="latin-1") as f:
        header = [h.split(":")[0] for h in f.readline().rstrip("\n").split("\t")]
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return header, rows


class _Raw:
    """Token -> its raw key: the file's integer id for ``numeric`` features, else a 64-bit hash
    of the feature name and the token; 0 for missing. ``len`` counts the distinct tokens seen."""

    def __init__(self, name: str, numeric: bool):
        self.name, self.numeric = name, numeric
        self.index: dict[str, int] = {}

    def __call__(self, token: str) -> int:
        if not token:
            return 0
        key = self.index.get(token)
        if key is None:
            if self.numeric:
                key = int(token)
            else:
                digest = hashlib.blake2b(f"{self.name}\x1f{token}".encode(), digest_size=8)
                key = int.from_bytes(digest.digest(), "little", signed=True)
            self.index[token] = key
        return key

    def __len__(self) -> int:
        return len(self.index) + 1


class _Vocab:
    """Token -> id, 0 reserved for missing."""

    def __init__(self):
        self.index: dict[str, int] = {}

    def __call__(self, token: str) -> int:
        if not token:
            return 0
        return self.index.setdefault(token, len(self.index) + 1)

    def __len__(self) -> int:
        return len(self.index) + 1


@dataclass
class MovieLens:
    train: InMemoryClicks
    test: InMemoryClicks
    features: list[FeatureSpec]
    folder: Path
    valid: InMemoryClicks | None = None  # with valid_fraction > 0


def _ragged(lists: list[list[int]]) -> Ragged:
    return Ragged(
        np.array([x for s in lists for x in s], dtype=np.int64),
        lengths=np.array([len(s) for s in lists], dtype=np.int64),
    )


def load_movielens_100k(
    folder: str | Path | None = None,
    test_fraction: float = 0.2,
    valid_fraction: float = 0.0,
    raw_ids: bool = False,
) -> MovieLens:
    folder = Path(folder) if folder is not None else find_movielens_100k()
    _, inter = _read_table(folder / "ml-100k.inter")
    u_head, users = _read_table(folder / "ml-100k.user")
    i_head, items = _read_table(folder / "ml-100k.item")

    names = (
        "user_id",
        "item_id",
        "age",
        "gender",
        "occupation",
        "zip_prefix",
        "release_year",
        "genres",
        "title_words",
    )
    if raw_ids:
        vocab = {name: _Raw(name, name in ("user_id", "item_id")) for name in names}
    else:
        vocab = {name: _Vocab() for name in names}
    user_info = {}
    for row in users:
        rec = dict(zip(u_head, row, strict=False))
        user_info[rec["user_id"]] = (
            vocab["age"](rec.get("age", "")),
            vocab["gender"](rec.get("gender", "")),
            vocab["occupation"](rec.get("occupation", "")),
            vocab["zip_prefix"](rec.get("zip_code", "")[:2]),
        )
    item_info = {}
    for row in items:
        rec = dict(zip(i_head, row, strict=False))
        title = [vocab["title_words"](w.lower()) for w in rec.get("movie_title", "").split()]
        genres = [vocab["genres"](g) for g in rec.get("class", "").split()]
        year = rec.get("release_year", "")
        year = year if year.isdigit() else ""  # the file has "unkonwn" for one movie
        item_info[rec["item_id"]] = (vocab["release_year"](year), genres, title)

    n = len(inter)
    user = np.empty(n, np.int64)
    item = np.empty(n, np.int64)
    ts = np.empty(n, np.float64)
    label = np.empty(n, np.float32)
    uinfo = np.zeros((n, 4), np.int64)
    year = np.zeros(n, np.int64)
    genres: list[list[int]] = []
    titles: list[list[int]] = []
    for k, (u, i, rating, t) in enumerate(inter):
        user[k] = vocab["user_id"](u)
        item[k] = vocab["item_id"](i)
        ts[k] = float(t)
        label[k] = float(rating) >= 4.0
        uinfo[k] = user_info.get(u, (0, 0, 0, 0))
        y, g, w = item_info.get(i, (0, [], []))
        year[k] = y
        genres.append(g)
        titles.append(w)

    # Per user, the latest test_fraction of interactions (by time, then file order) is the test,
    # the latest valid_fraction of the rest the validation set.
    order = np.lexsort((np.arange(n), ts, user))
    is_test = np.zeros(n, dtype=bool)
    is_valid = np.zeros(n, dtype=bool)
    starts = np.flatnonzero(np.r_[True, user[order][1:] != user[order][:-1]])
    ends = np.r_[starts[1:], n]
    for s, e in zip(starts, ends, strict=True):
        k = int(round((e - s) * test_fraction))
        is_test[order[e - k : e]] = True
        v = int(round((e - s - k) * valid_fraction))
        is_valid[order[e - k - v : e - k]] = True

    def subset(mask):
        idx = np.flatnonzero(mask)
        return InMemoryClicks(
            features={
                "user_id": user[idx],
                "item_id": item[idx],
                "age": uinfo[idx, 0],
                "gender": uinfo[idx, 1],
                "occupation": uinfo[idx, 2],
                "zip_prefix": uinfo[idx, 3],
                "release_year": year[idx],
                "genres": _ragged([genres[j] for j in idx]),
                "title_words": _ragged([titles[j] for j in idx]),
            },
            dense=np.zeros((len(idx), 0), np.float32),
            labels=label[idx],
        )

    specs = [FeatureSpec(name, len(v)) for name, v in vocab.items()]
    specs = [
        FeatureSpec(s.name, s.vocabulary_size, combiner="mean", multi_valued=True)
        if s.name == "genres"
        else FeatureSpec(s.name, s.vocabulary_size, combiner="sqrtn", multi_valued=True)
        if s.name == "title_words"
        else s
        for s in specs
    ]
    valid = subset(is_valid) if valid_fraction > 0 else None
    return MovieLens(subset(~is_test & ~is_valid), subset(is_test), specs, folder, valid)
