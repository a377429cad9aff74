"""MovieLens-100K as implicit-feedback CTR, from the copy that the PyPI package ``recbole`` ships.

Click = rating >= 4. Features: user id, item id, age, gender, occupation, zip prefix (first 2
characters), release year, genres (multi-valued, mean) and title words (multi-valued, sqrtn).
Split: for each user, the latest 20% of their interactions by timestamp (rounded, ties broken by
file order) form the test set; with ``valid_fraction`` > 0, the latest ``valid_fraction`` of the
rest (rounded) form a validation set, cut the same way, for choosing an epoch without the test.
Token 0 of every vocabulary means "missing". Columns are found by their header's names; a row
with another number of fields than the header, a rating or timestamp that is no finite number, or
a file without rows is a ValueError naming the file and line.

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


def _read_table(path: Path, needed: tuple[str, ...]) -> tuple[list[str], list[tuple[int, list]]]:
    """The header's column names and the rows, each with its line number (blank lines skipped);
    ValueError naming the file if the header lacks one of ``needed``."""
    with open(path, encoding="latin-1") as f:
        header = [h.split(":")[0] for h in f.readline().rstrip("\r\n").split("\t")]
        rows = [
            (n, line.rstrip("\r\n").split("\t"))
            for n, line in enumerate(f, start=2)
            if line.strip()
        ]
    for name in needed:
        if name not in header:
            raise ValueError(
                f"{path}: no column {name!r} in its header {header!r}; a MovieLens-100K file in "
                f"recbole's format starts with the tab-separated names {needed[0]}:token, ..."
            )
    return header, rows


def _number(path: Path, line: int, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value):
        raise ValueError(f"{path}, line {line}: {name} {text!r} is not a finite number")
    return value


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
                try:
                    key = int(token)
                except ValueError:
                    key = None
                if key is None or not -(2**63) <= key < 2**63:
                    raise ValueError(
                        f"{self.name} {token!r} is not an int64 (--vocabulary dynamic keys the "
                        "tables by the files' ids)"
                    )
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
    inter_path = folder / "ml-100k.inter"
    columns = ("user_id", "item_id", "rating", "timestamp")
    head, inter = _read_table(inter_path, columns)
    if not inter:
        raise ValueError(f"{inter_path} holds no interactions (no row after its header)")
    where = [head.index(c) for c in columns]
    u_head, users = _read_table(folder / "ml-100k.user", ("user_id",))
    i_head, items = _read_table(folder / "ml-100k.item", ("item_id",))

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
    for _, row in users:
        rec = dict(zip(u_head, row, strict=False))
        user_info[rec["user_id"]] = (
            vocab["age"](rec.get("age", "")),
            vocab["gender"](rec.get("gender", "")),
            vocab["occupation"](rec.get("occupation", "")),
            vocab["zip_prefix"](rec.get("zip_code", "")[:2]),
        )
    item_info = {}
    for _, row in items:
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
    for k, (line, row) in enumerate(inter):
        if len(row) != len(head):
            raise ValueError(
                f"{inter_path}, line {line}: {len(row)} fields, its header names {len(head)}"
            )
        u, i, rating, t = (row[c] for c in where)
        try:
            user[k] = vocab["user_id"](u)
            item[k] = vocab["item_id"](i)
        except ValueError as e:
            raise ValueError(f"{inter_path}, line {line}: {e}") from None
        ts[k] = _number(inter_path, line, "timestamp", t)
        label[k] = _number(inter_path, line, "rating", rating) >= 4.0
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
