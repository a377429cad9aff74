"""Training data: MovieLens-100K (real, from recbole's package data), the synthetic click log and
the evaluation metrics."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embengine.data import ClickBatch, SyntheticClicks, load_movielens_100k
from embengine.data import movielens as ml
from embengine.data.dataset import InMemoryClicks
from embengine.inputs import Ragged
from embengine.training.metrics import auc, logloss
from embengine.training.sources import SyntheticSource

FEATURES = (
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
MULTI = {"genres": "mean", "title_words": "sqrtn"}


# -- MovieLens-100K ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ml100k():
    return load_movielens_100k()


@pytest.fixture(scope="module")
def raw_inter(ml100k):
    """The raw interaction file: user, item (raw tokens), rating, timestamp, in file order."""
    with open(ml100k.folder / "ml-100k.inter", encoding="latin-1") as f:
        header = f.readline().rstrip("\n").split("\t")
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    assert [h.split(":")[0] for h in header] == ["user_id", "item_id", "rating", "timestamp"]
    return rows


def _column(split: InMemoryClicks, name: str) -> np.ndarray:
    col = split.features[name]
    assert isinstance(col, np.ndarray), f"{name} should be single-valued"
    return col


def _expected_split(rows, fraction=0.2):
    """Per raw user: the indices (file order) of their test interactions, computed from scratch."""
    per_user = defaultdict(list)
    for k, (u, _i, _r, t) in enumerate(rows):
        per_user[u].append((float(t), k))
    test = set()
    for items in per_user.values():
        items.sort()
        n_test = int(round(len(items) * fraction))
        test.update(k for _, k in items[len(items) - n_test :])
    return per_user, test


def test_movielens_sizes_and_label_totals(ml100k, raw_inter):
    assert len(raw_inter) == 100_000
    assert len(ml100k.train) == 80_000
    assert len(ml100k.test) == 20_000
    n_pos = sum(float(r) >= 4 for _, _, r, _ in raw_inter)
    got = float(ml100k.train.labels.sum() + ml100k.test.labels.sum())
    assert got == n_pos
    for split in (ml100k.train, ml100k.test):
        assert split.labels.dtype == np.float32
        assert set(np.unique(split.labels)) <= {0.0, 1.0}
        assert split.dense.shape == (len(split), 0)


def test_movielens_split_signatures_match_raw_file(ml100k, raw_inter):
    """Mapping-free check of the split: per user and per item, (#train, #test, #train clicks,
    #test clicks) agree with the latest-20%-by-timestamp rule applied to the raw file."""
    _, test_rows = _expected_split(raw_inter)

    def raw_signature(key_index):
        sig = defaultdict(lambda: [0, 0, 0, 0])
        for k, row in enumerate(raw_inter):
            is_test = k in test_rows
            pos = float(row[2]) >= 4
            s = sig[row[key_index]]
            s[1 if is_test else 0] += 1
            s[3 if is_test else 2] += pos
        return sorted(map(tuple, sig.values()))

    def our_signature(name):
        sig = defaultdict(lambda: [0, 0, 0, 0])
        for is_test, split in ((False, ml100k.train), (True, ml100k.test)):
            for key, y in zip(_column(split, name), split.labels, strict=True):
                s = sig[int(key)]
                s[1 if is_test else 0] += 1
                s[3 if is_test else 2] += int(y)
        return sorted(map(tuple, sig.values()))

    assert our_signature("user_id") == raw_signature(0)
    assert our_signature("item_id") == raw_signature(1)


def test_movielens_every_users_test_is_their_latest_20_percent(ml100k, raw_inter):
    """Row-level check: map our ids back to the raw tokens (ids are given in order of first
    appearance) and check timestamps, counts and labels for every user."""
    user_tok, item_tok = {}, {}
    for u, i, _, _ in raw_inter:
        user_tok.setdefault(u, len(user_tok) + 1)
        item_tok.setdefault(i, len(item_tok) + 1)
    raw = {(user_tok[u], item_tok[i]): (float(t), float(r)) for u, i, r, t in raw_inter}
    assert len(raw) == 100_000  # (user, item) pairs are unique in ML-100K

    def rows(split):
        return list(
            zip(
                _column(split, "user_id").tolist(),
                _column(split, "item_id").tolist(),
                split.labels.tolist(),
                strict=True,
            )
        )

    train_rows, test_rows = rows(ml100k.train), rows(ml100k.test)
    if {(u, i) for u, i, _ in train_rows + test_rows} != set(raw):
        pytest.skip("ids are not numbered by first appearance; covered by the signature test")

    train_ts, test_ts = defaultdict(list), defaultdict(list)
    for target, split_rows in ((train_ts, train_rows), (test_ts, test_rows)):
        for u, i, y in split_rows:
            t, rating = raw[(u, i)]
            assert y == float(rating >= 4), (u, i, rating, y)
            target[u].append(t)
    assert set(train_ts) == set(test_ts) == set(range(1, 944))
    for u in train_ts:
        n = len(train_ts[u]) + len(test_ts[u])
        assert len(test_ts[u]) == round(0.2 * n), u
        assert min(test_ts[u]) >= max(train_ts[u]), u


def test_movielens_features(ml100k):
    specs = {f.name: f for f in ml100k.features}
    assert tuple(specs) == FEATURES
    for name, spec in specs.items():
        if name in MULTI:
            assert spec.multi_valued and spec.combiner == MULTI[name], spec
        else:
            assert not spec.multi_valued, spec
    assert specs["user_id"].vocabulary_size == 943 + 1  # + the reserved "missing" id 0
    assert specs["item_id"].vocabulary_size == 1682 + 1
    assert specs["gender"].vocabulary_size == 2 + 1
    assert specs["occupation"].vocabulary_size == 21 + 1
    for split in (ml100k.train, ml100k.test):
        assert set(split.features) == set(FEATURES)
        for name, col in split.features.items():
            v = specs[name].vocabulary_size
            if name in MULTI:
                assert isinstance(col, Ragged)
                assert len(col.lengths) == len(split)
                assert col.lengths.min() >= 1  # every movie has a genre and a title
                ids = col.ids
            else:
                assert col.shape == (len(split),)
                ids = col
            assert ids.dtype == np.int64
            assert ids.min() >= 0 and ids.max() < v, name
        # Ids and users are never missing, so never the reserved 0.
        for name in ("user_id", "item_id", "gender", "occupation", "age", "zip_prefix"):
            assert _column(split, name).min() >= 1, name
    # Every token of a vocabulary has an id below its size and all ids are used.
    both = {
        n: np.concatenate([_column(ml100k.train, n), _column(ml100k.test, n)])
        for n in ("user_id", "item_id")
    }
    for name, ids in both.items():
        assert set(np.unique(ids)) == set(range(1, specs[name].vocabulary_size))


def test_movielens_is_deterministic(ml100k):
    again = load_movielens_100k()
    assert again.features == ml100k.features
    for a, b in ((ml100k.train, again.train), (ml100k.test, again.test)):
        np.testing.assert_array_equal(a.labels, b.labels)
        for name in FEATURES:
            x, y = a.features[name], b.features[name]
            if isinstance(x, Ragged):
                np.testing.assert_array_equal(x.ids, y.ids)
                np.testing.assert_array_equal(x.offsets, y.offsets)
            else:
                np.testing.assert_array_equal(x, y)


def test_in_memory_batches_cover_the_split(ml100k):
    """Batches (with the ragged features re-sliced) reproduce the columns, shuffled or not."""
    split = ml100k.test
    batches = list(split.batches(777))
    assert sum(len(b) for b in batches) == len(split)
    assert all(isinstance(b, ClickBatch) for b in batches)
    genres = split.features["genres"]
    got = np.concatenate([b.sparse["genres"].ids for b in batches])
    np.testing.assert_array_equal(got, genres.ids)
    np.testing.assert_array_equal(
        np.concatenate([b.sparse["user_id"].ids for b in batches]), split.features["user_id"]
    )
    order = np.random.default_rng(3).permutation(len(split))
    shuffled = list(split.batches(1000, shuffle=True, seed=3))
    users = np.concatenate([b.sparse["user_id"].ids for b in shuffled])
    np.testing.assert_array_equal(users, split.features["user_id"][order])
    k = int(order[5])
    titles = split.features["title_words"]
    sample = shuffled[0].sparse["title_words"]
    np.testing.assert_array_equal(
        sample.ids[sample.offsets[5] : sample.offsets[6]],
        titles.ids[titles.offsets[k] : titles.offsets[k + 1]],
    )


def _write_fake_movielens(folder: Path):
    """A tiny dataset in recbole's format. Every interaction has its own movie, identified by the
    number of words in its title (1, 2, ...): ids are remapped, lengths survive."""
    inter = [  # user, title length, rating, timestamp
        ("7", 1, 5, 100), ("7", 2, 1, 50), ("7", 3, 4, 300), ("7", 4, 3, 200), ("7", 5, 4, 250),
        ("7", 6, 2, 10), ("7", 7, 5, 20),  # 7 -> 1 test: title 3 (t=300)
        ("8", 8, 4, 900), ("8", 9, 1, 900), ("8", 10, 2, 5), ("8", 11, 3, 900), ("8", 12, 4, 6),
        ("8", 13, 5, 7), ("8", 14, 1, 8), ("8", 15, 2, 9), ("8", 16, 3, 1), ("8", 17, 4, 2),
        # 8 -> 2 test among three ties at t=900: the later two in file order (9 and 11)
        ("9", 18, 4, 40), ("9", 19, 1, 30), ("9", 20, 2, 20), ("9", 21, 5, 10), ("9", 22, 4, 50),
        ("9", 23, 5, 60), ("9", 24, 1, 70), ("9", 25, 2, 80), ("9", 26, 3, 90), ("9", 27, 4, 95),
        ("9", 28, 5, 96), ("9", 29, 1, 97), ("9", 0, 4, 98),  # 9 -> 3 test: titles 29, 0, 28
    ]  # fmt: skip
    with open(folder / "ml-100k.inter", "w", encoding="latin-1") as f:
        f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
        for u, length, r, t in inter:
            f.write(f"{u}\tm{length}\t{r}\t{t}\n")
    with open(folder / "ml-100k.user", "w", encoding="latin-1") as f:
        f.write("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n")
        f.write("7\t24\tM\ttechnician\t85711\n")
        f.write("8\t53\t\tother\t94043\n")  # no gender; user 9 is not in the file at all
    with open(folder / "ml-100k.item", "w", encoding="latin-1") as f:
        f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
        for length in range(1, 30):  # movie m0 is not in the file
            title = " ".join(f"Word{j}" for j in range(length))
            year = "" if length == 2 else str(1950 + length)
            genres = "" if length == 2 else "Comedy Drama"[: 6 if length % 2 else 12]
            f.write(f"m{length}\t{title}\t{year}\t{genres}\n")
    return inter


def test_movielens_split_rule_and_missing_values_on_a_small_file(tmp_path):
    inter = _write_fake_movielens(tmp_path)
    data = load_movielens_100k(tmp_path)
    assert data.folder == tmp_path

    def by_user(split):
        out = defaultdict(list)
        users = _column(split, "user_id")
        lengths = split.features["title_words"].lengths
        for b in range(len(split)):
            out[int(users[b])].append((int(lengths[b]), float(split.labels[b])))
        return out

    train, test = by_user(data.train), by_user(data.test)
    sizes = {len(train[u]) + len(test[u]): u for u in train}  # users 7, 8, 9 have 7, 10, 13
    assert sorted(sizes) == [7, 10, 13]
    expected_test = {7: {3}, 10: {9, 11}, 13: {29, 0, 28}}
    for n, titles in expected_test.items():
        assert {length for length, _ in test[sizes[n]]} == titles, n
    labels = {length: float(r >= 4) for _, length, r, _ in inter}
    for split in (train, test):
        for rows in split.values():
            for length, y in rows:
                assert y == labels[length]
    # Missing values are id 0: user 9 has no demographics, user 8 no gender, movie m0 nothing,
    # movie m2 no year and no genres.
    for split in (data.train, data.test):
        users = _column(split, "user_id")
        titles = split.features["title_words"].lengths
        genres = split.features["genres"].lengths
        for b in range(len(split)):
            n = len(train[int(users[b])]) + len(test[int(users[b])])
            demo = [
                int(_column(split, f)[b]) for f in ("age", "gender", "occupation", "zip_prefix")
            ]
            if n == 13:
                assert demo == [0, 0, 0, 0]
            elif n == 10:
                assert demo[1] == 0 and min(demo[0], demo[2], demo[3]) >= 1
            else:
                assert min(demo) >= 1
            year = int(_column(split, "release_year")[b])
            if titles[b] in (0, 2):
                assert year == 0 and genres[b] == 0
            else:
                assert year >= 1 and genres[b] >= 1


def _edit_inter(folder: Path, edit) -> Path:
    path = folder / "ml-100k.inter"
    lines = path.read_text(encoding="latin-1").splitlines(keepends=True)
    path.write_text("".join(edit(lines)), encoding="latin-1")
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ls: [*ls[:4], "7\tm30\t4\n", *ls[4:]], r"ml-100k.inter, line 5: 3 fields"),
        (lambda ls: [*ls[:6], "7\tm30\tfive\t9\n", *ls[6:]], r"line 7: rating 'five'"),
        (lambda ls: [*ls[:3], "7\tm30\tnan\t9\n", *ls[3:]], r"line 4: rating 'nan'"),
        (lambda ls: [*ls[:2], "7\tm30\t4\t\n", *ls[2:]], r"line 3: timestamp ''"),
        (lambda ls: ls[:1], r"ml-100k.inter holds no interactions"),
        (lambda ls: [], r"ml-100k.inter: no column 'user_id'.*user_id:token"),
        (lambda ls: [ls[0].replace("rating", "score"), *ls[1:]], r"no column 'rating'"),
    ],
)
def test_a_bad_interactions_file_is_an_error_naming_its_file_and_line(tmp_path, edit, message):
    """A row with missing fields, a rating or timestamp that is no finite number, no rows or a
    header without the columns read: a ValueError naming the file and line (was: "not enough
    values to unpack", "could not convert string to float", a NaN rating read as no click,
    StopIteration from the trainer's first batch)."""
    _write_fake_movielens(tmp_path)
    _edit_inter(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_movielens_100k(tmp_path)


def test_interactions_are_read_by_their_header_names(tmp_path):
    """The columns are found by the header's names, in any order (was: by position, so a file
    with its columns in another order trained on ratings as user ids, silently)."""
    _write_fake_movielens(tmp_path)
    want = load_movielens_100k(tmp_path)

    def reorder(lines):
        rows = [line.rstrip("\n").split("\t") for line in lines]
        return ["\t".join([r[2], r[3], r[1], r[0]]) + "\n" for r in rows]

    _edit_inter(tmp_path, reorder)
    got = load_movielens_100k(tmp_path)
    for name in ("train", "valid", "test"):
        a, b = getattr(want, name), getattr(got, name)
        if a is None:
            continue
        np.testing.assert_array_equal(a.labels, b.labels)
        for f in FEATURES:
            if f in MULTI:
                for part in ("ids", "offsets"):
                    got_part = getattr(b.features[f], part)
                    np.testing.assert_array_equal(getattr(a.features[f], part), got_part)
            else:
                np.testing.assert_array_equal(_column(a, f), _column(b, f))


def test_a_raw_id_that_is_no_int64_names_its_file_and_line(tmp_path):
    """--vocabulary dynamic keys the tables by the files' user and item ids: one that is no
    int64 is a ValueError naming the file and line (was: int() of 'm1' with neither)."""
    _write_fake_movielens(tmp_path)
    with pytest.raises(ValueError, match=r"ml-100k.inter, line 2: item_id 'm1' is not an int64"):
        load_movielens_100k(tmp_path, raw_ids=True)


def test_find_movielens_without_recbole_says_how_to_install(monkeypatch):
    monkeypatch.delenv("EMBENGINE_ML100K_DIR", raising=False)
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps recbole"):
        ml.find_movielens_100k()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps recbole"):
        load_movielens_100k()


def test_find_movielens_uses_env_dir(monkeypatch, tmp_path, ml100k):
    for ext in ("inter", "user", "item"):
        shutil.copy(ml100k.folder / f"ml-100k.{ext}", tmp_path / f"ml-100k.{ext}")
    monkeypatch.setenv("EMBENGINE_ML100K_DIR", str(tmp_path))
    # Preferred even when recbole is installed ...
    assert ml.find_movielens_100k() == tmp_path
    # ... and enough without it.
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda *a, **k: None)
    assert ml.find_movielens_100k() == tmp_path
    data = load_movielens_100k()
    assert data.folder == tmp_path
    assert (len(data.train), len(data.test)) == (80_000, 20_000)
    # A folder missing one of the three files is not used.
    (tmp_path / "ml-100k.item").unlink()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps recbole"):
        ml.find_movielens_100k()


# -- synthetic clicks ----------------------------------------------------------------------------


SMALL = (1, 2, 3, 10, 50, 100, 7, 1000, 5, 5, 20, 30, 40, 60, 70, 80, 90, 11, 13, 17, 19, 23, 29,
         31, 37, 41)  # fmt: skip


def _assert_same_batch(a: ClickBatch, b: ClickBatch):
    assert a.sparse.keys() == b.sparse.keys()
    for name in a.sparse:
        np.testing.assert_array_equal(a.sparse[name].ids, b.sparse[name].ids)
        np.testing.assert_array_equal(a.sparse[name].offsets, b.sparse[name].offsets)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)


def _differs(a: ClickBatch, b: ClickBatch) -> bool:
    same_ids = all(np.array_equal(a.sparse[n].ids, b.sparse[n].ids) for n in a.sparse)
    return not (
        same_ids and np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
    )


def test_synthetic_shape():
    data = SyntheticClicks(SMALL, seed=1)
    assert len(data.features) == 26
    assert [f.name for f in data.features] == [f"C{i}" for i in range(1, 27)]
    assert [f.vocabulary_size for f in data.features] == list(SMALL)
    batch = data.batch(0, 64)
    assert len(batch) == 64
    assert batch.dense.shape == (64, 13) and batch.dense.dtype == np.float32
    assert batch.labels.shape == (64,) and set(np.unique(batch.labels)) <= {0.0, 1.0}
    assert list(batch.sparse) == [f.name for f in data.features]
    for spec in data.features:
        r = batch.sparse[spec.name]
        np.testing.assert_array_equal(r.lengths, np.ones(64))  # one id per sample
        assert r.ids.min() >= 0 and r.ids.max() < spec.vocabulary_size
    # The default is Criteo-like: 26 vocabularies, the largest 100k.
    default = SyntheticClicks()
    assert len(default.features) == 26 and default.n_dense == 13


def test_synthetic_batches_are_a_pure_function_of_seed_stream_index():
    data = SyntheticClicks(SMALL, seed=3)
    a = data.batch(5, 128)
    _assert_same_batch(a, data.batch(5, 128))
    _assert_same_batch(a, SyntheticClicks(SMALL, seed=3).batch(5, 128))  # a fresh instance
    data.batch(0, 999)
    data.batch(6, 128, "test")  # other calls in between change nothing
    _assert_same_batch(a, data.batch(5, 128))
    assert _differs(a, data.batch(6, 128))
    assert _differs(a, data.batch(5, 128, "test"))
    assert _differs(a, SyntheticClicks(SMALL, seed=4).batch(5, 128))
    # batches() is the same batches by index, from any start.
    listed = list(data.batches(128, count=3, start=4))
    for i, b in zip((4, 5, 6), listed, strict=True):
        _assert_same_batch(b, data.batch(i, 128))
    # The validation stream is a third one, neither train nor test.
    assert _differs(a, data.batch(5, 128, "valid"))
    assert _differs(data.batch(5, 128, "test"), data.batch(5, 128, "valid"))
    with pytest.raises(ValueError, match="stream"):
        data.batch(0, 4, "holdout")


def test_synthetic_ids_are_zipf_like():
    v = 10**6
    ids = SyntheticClicks((v,), seed=0).batch(0, 200_000).sparse["C1"].ids
    assert ids.min() >= 0 and ids.max() < v
    counts = np.sort(np.bincount(ids, minlength=v))[::-1]
    top = counts[0] / len(ids)
    assert top > 1000 / v  # far above the uniform 1/v (it is ~0.09)
    assert np.all(np.diff(counts[:5]) < 0)
    assert len(np.unique(ids)) > 10_000  # but a long tail, not a handful of ids
    # Frequency vs rank is a power law with exponent about -zipf.
    ranks = np.arange(1, 51)
    slope = np.polyfit(np.log(ranks), np.log(counts[:50]), 1)[0]
    assert -1.4 < slope < -0.7


def test_synthetic_vocabulary_limit():
    with pytest.raises(ValueError, match="10\\^8"):
        SyntheticClicks((10, 10**8 + 1))
    with pytest.raises(ValueError):
        SyntheticSource(vocabulary_scale=10_001)  # largest default vocabulary becomes 10^9
    with pytest.raises(ValueError):
        SyntheticClicks((10, 0))


def test_synthetic_vocabulary_of_10_to_the_8_is_cheap():
    """A 10^8 vocabulary generates a batch quickly, without vocabulary-sized memory (a single
    float32 per id would be 400 MB). Measured in a fresh process: the peak RSS barely moves."""
    code = """
import resource, time
from embengine.data import SyntheticClicks
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
SyntheticClicks((10,) * 26).batch(0, 4096)  # compile the kernels first
before = peak()
t = time.perf_counter()
big = SyntheticClicks((10**8,) * 26)
b = big.batch(0, 4096)
seconds = time.perf_counter() - t
top = max(int(r.ids.max()) for r in b.sparse.values())
assert 0 <= min(int(r.ids.min()) for r in b.sparse.values()) and top < 10**8
print(peak() - before, seconds, top)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown_kb, seconds, top = out.stdout.split()
    assert int(grown_kb) < 100 * 1024, f"peak RSS grew by {int(grown_kb) // 1024} MB"
    assert float(seconds) < 5.0
    assert int(top) > 10**7  # the ids do spread over the big vocabulary


def test_synthetic_test_set_does_not_depend_on_the_batch_size():
    """The test stream is test_examples examples, the same whatever batch size reads it (the
    training loop reads it in batches of 8 x --batch-size), so AUCs and the oracle AUC of runs
    with different batch sizes are comparable."""
    sets = {}
    for eval_batch in (2048, 4096, 800):
        source = SyntheticSource(examples_per_epoch=5000, test_examples=5000, vocabulary_scale=0.01)
        labels = np.concatenate([b.labels for b in source.test_batches(eval_batch)])
        sets[eval_batch] = (len(labels), source.oracle_auc, labels)
    for n, _, _ in sets.values():
        assert n == 5000
    first = sets[2048]
    for _, oracle, labels in sets.values():
        assert oracle == pytest.approx(first[1], abs=1e-12)
        np.testing.assert_array_equal(labels, first[2])


def test_oracle_auc_bounds_a_trained_model():
    from embengine.training.loop import TrainConfig, train

    syn = {"examples_per_epoch": 5000, "test_examples": 8192, "vocabulary_scale": 0.01}
    source = SyntheticSource(**syn)
    assert source.oracle_auc is None  # known once the test stream has been read
    labels, probs = [], []
    from embengine.training.sources import TEST_CHUNK

    for i, batch in enumerate(source.test_batches(2048)):  # chunks of TEST_CHUNK, any batch size
        same, p = source.data.batch_with_probabilities(i, TEST_CHUNK, "test")
        _assert_same_batch(batch, same)
        labels.append(batch.labels)
        probs.append(p)
    oracle = source.oracle_auc
    assert oracle == pytest.approx(auc(np.concatenate(labels), np.concatenate(probs)), abs=1e-12)
    assert oracle > 0.7  # well above chance

    result = train(
        TrainConfig(
            dataset="synthetic",
            model="dlrm",
            steps=60,
            batch_size=256,
            progress=False,
            synthetic=syn,
        ),
        log=lambda s: None,
    )
    assert result.oracle_auc is not None and result.oracle_auc > 0.7
    assert 0.55 < result.test_auc <= result.oracle_auc + 0.005


# -- metrics -------------------------------------------------------------------------------------


def _pairwise_auc(labels, scores):
    pos = scores[labels.astype(bool)]
    neg = scores[~labels.astype(bool)]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=2, max_size=60).filter(
        lambda xs: 0 < sum(y for y, _ in xs) < len(xs)
    ),
    st.sampled_from([0.0, 0.5, 1e-3]),
)
def test_auc_is_the_pairwise_count_with_ties(pairs, jitter):
    labels = np.array([y for y, _ in pairs])
    scores = np.array([s for _, s in pairs], dtype=np.float64) * (1.0 + jitter)  # many ties
    assert auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)
    # Labels as floats (the batches' format) give the same.
    assert auc(labels.astype(np.float32), scores) == auc(labels, scores)


def test_auc_random_arrays_and_edge_values():
    rng = np.random.default_rng(0)
    for n in (2, 17, 500):
        labels = rng.random(n) < 0.3
        labels[:2] = [True, False]
        for scores in (rng.random(n), rng.integers(0, 4, n).astype(float)):
            assert auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)
    y = np.array([0, 0, 1, 1])
    assert auc(y, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert auc(y, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert auc(y, np.full(4, 0.5)) == 0.5


def test_auc_needs_both_classes():
    with pytest.raises(ValueError):
        auc(np.ones(5), np.arange(5.0))
    with pytest.raises(ValueError):
        auc(np.zeros(5), np.arange(5.0))
    with pytest.raises(ValueError):
        auc(np.zeros(0), np.zeros(0))


def test_logloss_matches_the_formula():
    rng = np.random.default_rng(1)
    y = (rng.random(300) < 0.4).astype(np.float32)
    p = rng.uniform(0.01, 0.99, 300)
    direct = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert logloss(y, p) == pytest.approx(direct, rel=1e-12)
    assert logloss(np.array([1.0, 0.0]), np.array([0.5, 0.5])) == pytest.approx(np.log(2))
    # Certain and right costs ~0; certain and wrong is clipped, finite.
    assert logloss(np.array([1.0, 0.0]), np.array([1.0, 0.0])) < 1e-6
    worst = logloss(np.array([1.0, 0.0]), np.array([0.0, 1.0]))
    assert np.isfinite(worst) and worst == pytest.approx(-np.log(1e-7), rel=1e-6)
