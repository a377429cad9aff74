"""The sharded step's bookkeeping kernels (embengine.kernels.shard_route) against NumPy: the
owner split of unique ids, the rows an owner answers with, the occurrences pushed per owner,
and the TableBatch an owner builds from what it received; for the "sums" exchange, the
occurrences packed per owner, the owner's batch of them and the partial sums added in rank
order (duplicate ids, empty batches, ids of one owner only, row and table sharding, 1 to 3
ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embengine.batch import csr, dedup
from embengine.inputs import read_only
from embengine.kernels import shard_route as sr

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def routes(draw):
    """(world, kind, owner): a sharding of one table, its kind a code as the engine passes it
    (an int: a bool would compile every kernel for a second argument type)."""
    world = draw(st.integers(1, 3))
    kind = draw(st.sampled_from([sr.KIND_ROW, sr.KIND_TABLE]))
    return world, kind, draw(st.integers(0, world - 1))


def owners_of(ids: np.ndarray, world: int, row: int, owner: int) -> np.ndarray:
    return ids % world if row == sr.KIND_ROW else np.full(len(ids), owner, dtype=np.int64)


def local_rows(ids: np.ndarray, world: int, row: int) -> np.ndarray:
    return ids // world if row == sr.KIND_ROW else ids.copy()


@st.composite
def id_lists(draw, size=30):
    """int64 ids with duplicates (a small vocabulary), maybe empty, maybe all of one owner."""
    v = draw(st.integers(1, 12))
    ids = draw(st.lists(st.integers(0, v - 1), max_size=size))
    if draw(st.booleans()):  # every id a multiple of 6: rank 0's alone under row sharding
        ids = [6 * i for i in ids]
    return np.array(ids, dtype=np.int64)


@SETTINGS
@given(route=routes(), ids=id_lists(), base=st.lists(st.integers(0, 50), min_size=3, max_size=3))
def test_route_ids_splits_unique_ids_by_owner_in_order(route, ids, base):
    world, row, owner = route
    unique, _ = dedup(ids)
    counts = np.zeros(world, dtype=np.int64)
    unique = read_only(unique)  # as the engine's batches hold them
    sr.count_owners(unique, row, owner, world, counts)
    owners = owners_of(unique, world, row, owner)
    np.testing.assert_array_equal(counts, np.bincount(owners, minlength=world))
    send_at = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    row_base = np.array(base[:world], dtype=np.int64)
    send = np.full(len(unique), -7, dtype=np.int64)
    rows = np.empty(len(unique), dtype=np.int64)
    sr.route_ids(unique, row, owner, world, send, send_at.copy(), rows, row_base)
    want_rows = np.empty(len(unique), dtype=np.int64)
    for d in range(world):
        sel = np.flatnonzero(owners == d)
        # Owner d's block: its ids in order of first appearance.
        np.testing.assert_array_equal(send[send_at[d] : send_at[d] + len(sel)], unique[sel])
        want_rows[sel] = row_base[d] + np.arange(len(sel))
    np.testing.assert_array_equal(rows, want_rows)


def _draw_owned(data, route, max_vocab: int) -> tuple[int, int, np.ndarray]:
    """A rank, a vocabulary of 1..max_vocab ids and the ids of it that rank owns, ascending."""
    world, row, owner = route
    rank = data.draw(st.integers(0, world - 1))
    vocab = data.draw(st.integers(1, max_vocab))
    owned = np.arange(vocab, dtype=np.int64)
    return rank, vocab, owned[owners_of(owned, world, row, owner) == rank]


@SETTINGS
@given(route=routes(), data=st.data())
def test_gather_rows_answers_with_the_owned_rows_and_names_a_stranger(route, data):
    world, row, _ = route
    rank, vocab, owned = _draw_owned(data, route, max_vocab=20)
    dim = data.draw(st.integers(1, 5))
    table = np.random.default_rng(vocab).normal(size=(max(len(owned), 1), dim + 2))
    table = table.astype(np.float32)[: len(owned)]
    blocks = [
        data.draw(st.lists(st.sampled_from(owned.tolist()), max_size=6)) if len(owned) else []
        for _ in range(world)
    ]
    ids = np.array([i for b in blocks for i in b], dtype=np.int64)
    starts = np.cumsum([0] + [len(b) for b in blocks])[:-1].astype(np.int64)
    stops = starts + np.array([len(b) for b in blocks], dtype=np.int64)
    # Blocks written in reverse order: the kernel must follow out_at.
    sizes = (stops - starts) * dim
    out_at = np.concatenate([[0], np.cumsum(sizes[::-1])[:-1]])[::-1].astype(np.int64).copy()
    out = np.full(len(ids) * dim, np.nan, dtype=np.float32)
    assert sr.gather_rows(table, dim, ids, starts, stops, row, world, rank, out, out_at) == -1
    for b in range(world):
        want = table[local_rows(ids[starts[b] : stops[b]], world, row), :dim].reshape(-1)
        np.testing.assert_array_equal(out[out_at[b] : out_at[b] + sizes[b]], want)
    # An id of another rank, or past this rank's rows, is refused by its position (here 1).
    stranger = (rank + 1) % world if row == sr.KIND_ROW and world > 1 else len(table)
    ids = np.array([owned[0] if len(owned) else 0, stranger], dtype=np.int64)
    zero, two = np.zeros(1, dtype=np.int64), np.full(1, 2, dtype=np.int64)
    start = zero if len(owned) else np.ones(1, dtype=np.int64)
    got = sr.gather_rows(
        table, dim, ids, start, two, row, world, rank, np.empty(2 * dim, np.float32), zero
    )
    assert got == 1


@st.composite
def table_batches(draw):
    """A table batch's occurrences (ids, gains, non-decreasing segments), with a feature's
    span: activation rows [a, b), occurrences [lo, hi)."""
    ids = draw(id_lists(size=40))
    n = len(ids)
    num_outputs = draw(st.integers(1, 8))
    segments = np.sort(
        np.array(
            draw(st.lists(st.integers(0, num_outputs - 1), min_size=n, max_size=n)), dtype=np.int64
        )
    )
    gains = np.array(
        draw(st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n)), dtype=np.float32
    )
    a = draw(st.integers(0, num_outputs))
    b = draw(st.integers(a, num_outputs))
    offsets, _ = csr(segments, num_outputs)
    return ids, gains, segments, num_outputs, a, b, int(offsets[a]), int(offsets[b])


def push_reference(unique, inverse, segments, gains, lo, hi, start, grad, world, row, owner):
    """What the first ShardedEngine sent each owner for one feature (NumPy)."""
    ids = unique[inverse[lo:hi]]
    owners = owners_of(ids, world, row, owner)
    out = []
    for d in range(world):
        sel = np.flatnonzero(owners == d)
        useg, at = np.unique(segments[lo:hi][sel], return_inverse=True)
        out.append(
            (ids[sel], at.reshape(-1).astype(np.int64), gains[lo:hi][sel], grad[useg - start])
        )
    return out


@SETTINGS
@given(route=routes(), batch=table_batches(), dim=st.integers(1, 4))
def test_push_cuts_a_features_occurrences_by_owner(route, batch, dim):
    world, row, owner = route
    ids, gains, segments, num_outputs, a, b, lo, hi = batch
    unique, inverse = dedup(ids)
    grad = np.random.default_rng(len(ids)).normal(size=(b - a, dim)).astype(np.float32)
    n = np.zeros(world, dtype=np.int64)
    m = np.zeros(world, dtype=np.int64)
    owners = np.full(len(unique), -1, dtype=np.int64)
    # the batch's arrays read-only, as the engine's batches hold them
    unique, inverse, segments, gains = map(read_only, (unique, inverse, segments, gains))
    sr.owners_of(unique, row, owner, world, owners)
    np.testing.assert_array_equal(owners, owners_of(unique, world, row, owner))
    sr.count_push(owners, inverse, segments, lo, hi, world, n, m)
    want = push_reference(unique, inverse, segments, gains, lo, hi, a, grad, world, row, owner)
    assert n.tolist() == [len(w[0]) for w in want]
    assert m.tolist() == [len(w[3]) for w in want]
    # Blocks in reverse owner order, with a gap: the kernel must follow the offsets given.
    int_at = np.zeros(world, dtype=np.int64)
    row_at = np.zeros(world, dtype=np.int64)
    pi = pr = 1
    for d in reversed(range(world)):
        int_at[d], row_at[d] = pi, pr
        pi, pr = pi + 2 * n[d] + 1, pr + m[d] * dim + 1
    ints = np.full(pi, -9, dtype=np.int64)
    rows_out = np.full(pr, np.nan, dtype=np.float32)
    sr.fill_push(
        unique,
        owners,
        inverse,
        segments,
        gains.view(np.int32),
        lo,
        hi,
        a,
        grad,
        world,
        n,
        ints,
        int_at,
        rows_out,
        row_at,
    )
    for d, (w_ids, w_at, w_gains, w_rows) in enumerate(want):
        k = len(w_ids)
        np.testing.assert_array_equal(ints[int_at[d] : int_at[d] + k], w_ids)
        assert_packed(ints[int_at[d] + k : int_at[d] + 2 * k], w_at, w_gains)
        got_rows = rows_out[row_at[d] : row_at[d] + len(w_rows) * dim].reshape(-1, dim)
        np.testing.assert_array_equal(got_rows, w_rows)


def pack(at: np.ndarray, gains: np.ndarray) -> np.ndarray:
    """Words as ``fill_pull`` and ``fill_push`` pack them: each occurrence's activation (or
    gradient) row index in the high 32 bits over its float32 gain's bits."""
    return (at << 32) | gains.view(np.uint32).astype(np.int64)


def assert_packed(words: np.ndarray, at: np.ndarray, gains: np.ndarray) -> None:
    """``words`` are ``pack(at, gains)``, the gains bit for bit."""
    np.testing.assert_array_equal(words >> 32, at)
    bits = (words & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    assert bits.tobytes() == gains.tobytes()


def owner_batch_reference(blocks):
    """The first ShardedEngine's owner batch (NumPy: dedup, csr, stable sorts): ``blocks`` of
    (ids, gradient-row index, gains, first gradient row)."""
    ids = np.concatenate([b[0] for b in blocks] + [np.zeros(0, np.int64)])
    segments = np.concatenate([b[1] + b[3] for b in blocks] + [np.zeros(0, np.int64)])
    gains = np.concatenate([b[2] for b in blocks] + [np.zeros(0, np.float32)])
    return ids, segments, gains


def _draw_blocks(data, owned: np.ndarray, in_order: bool, gaps: bool) -> tuple[list, int]:
    """(blocks, rows): up to 4 blocks of an owner's occurrences as they arrive (one per feature
    and sender), each ``(ids, row index of each occurrence, gains, first row, rows)``, its rows
    after the blocks before it (``gaps``: with rows of other tables between); ``in_order``:
    row indices non-decreasing, as a bag's occurrences come."""
    blocks, base = [], 0
    for _ in range(data.draw(st.integers(0, 4))):
        k = data.draw(st.integers(0, 6)) if len(owned) else 0
        ids = np.array([data.draw(st.sampled_from(owned.tolist())) for _ in range(k)], np.int64)
        rows = data.draw(st.integers(k > 0, max(k, 1)))
        at = np.array([data.draw(st.integers(0, rows - 1)) for _ in range(k)], np.int64)
        gains = np.array([data.draw(st.floats(-2, 2, width=32)) for _ in range(k)], np.float32)
        blocks.append((ids, np.sort(at) if in_order else at, gains, base, rows))
        base += rows + (data.draw(st.integers(0, 2)) if gaps else 0)
    return blocks, base


def _assert_owner_batch(out, u, ids, segments, gains, num_outputs, world, row) -> None:
    """``out`` (``_blocks_out``'s arrays, ``u`` unique ids) is the single engine's TableBatch of
    occurrences ``ids`` / ``segments`` / ``gains``: dedup in order of first appearance, CSR
    views by output and, stably, by unique id."""
    unique, inverse = dedup(ids)
    unique_offsets, by_unique = csr(inverse, len(unique))
    assert u == len(unique)
    np.testing.assert_array_equal(out["unique"][:u], unique)
    np.testing.assert_array_equal(out["inverse"], inverse)
    if "gains" in out:
        assert out["gains"].tobytes() == gains.tobytes()
    np.testing.assert_array_equal(out["segments"], segments)
    np.testing.assert_array_equal(out["unique_rows"][:u], local_rows(unique, world, row))
    np.testing.assert_array_equal(out["output_offsets"], csr(segments, num_outputs)[0])
    np.testing.assert_array_equal(out["unique_offsets"][: u + 1], unique_offsets)
    assert out["unique_gains"].tobytes() == gains[by_unique].tobytes()
    np.testing.assert_array_equal(out["unique_segments"], segments[by_unique])


@SETTINGS
@given(route=routes(), data=st.data())
def test_owner_batch_is_the_single_engines_batch_of_the_owners_rows(route, data):
    world, row, _ = route
    rank, _, owned = _draw_owned(data, route, max_vocab=15)
    n_rows = int(local_rows(owned, world, row).max()) + 1 if len(owned) else 0
    # Blocks as they arrive (one per feature and sender), each with its own gradient rows.
    blocks, num_outputs = _draw_blocks(data, owned, in_order=False, gaps=True)
    # Lay the blocks out shuffled in the buffers: the kernel must follow the offsets.
    order = data.draw(st.permutations(range(len(blocks))))
    ints = [np.zeros(1, np.int64)]
    int_at = np.zeros(len(blocks), np.int64)
    pi = 1
    for b in order:
        ids, at, gains, _, _ = blocks[b]
        int_at[b] = pi
        ints += [ids, pack(at, gains)]
        pi += 2 * len(ids)
    ints = np.concatenate(ints)
    counts = np.array([len(b[0]) for b in blocks], dtype=np.int64)
    row_base = np.array([b[3] for b in blocks], dtype=np.int64)
    out = _blocks_out(int(counts.sum()), num_outputs)
    u = sr.owner_batch(
        ints, int_at, counts, row_base, row, world, rank, n_rows, num_outputs, *_bits(out)
    )
    ids, segments, gains = owner_batch_reference([b[:4] for b in blocks])
    _assert_owner_batch(out, u, ids, segments, gains, num_outputs, world, row)


@pytest.mark.parametrize("row", [sr.KIND_ROW, sr.KIND_TABLE])
def test_owner_batch_refuses_an_id_this_rank_does_not_hold(row):
    # Rank 0 of 2 holds ids 0, 2, 4 (row) or the whole table of 3 rows; id 5 is neither.
    one_gain = 0x3F800000  # 1.0's bits, at gradient row 0
    ints = np.array([2, 5, one_gain, one_gain], dtype=np.int64)  # ids 2 and 5
    one = np.zeros(1, dtype=np.int64)
    out = _blocks_out(2, 1)
    got = sr.owner_batch(ints, one, np.array([2]), one, row, 2, 0, 3, 1, *_bits(out))
    assert got == -1 - 1  # occurrence 1 (id 5)


def _blocks_out(total: int, num_outputs: int) -> dict[str, np.ndarray]:
    """The arrays an owner's TableBatch kernel fills (``owner_batch``'s order)."""
    return dict(
        unique=np.empty(total, np.int64),
        inverse=np.empty(total, np.int64),
        gains=np.empty(total, np.float32),
        segments=np.empty(total, np.int64),
        unique_rows=np.empty(total, np.int64),
        output_offsets=np.empty(num_outputs + 1, np.int64),
        unique_offsets=np.empty(total + 1, np.int64),
        unique_gains=np.empty(total, np.float32),
        unique_segments=np.empty(total, np.int64),
    )


def _bits(out: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``_blocks_out``'s arrays as ``owner_batch`` takes them: the gains as int32 views."""
    return [a.view(np.int32) if "gains" in k else a for k, a in out.items()]


def _starts(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def _decode(packed, at, counts, block_rows, row, world, rank, n_rows, parts=None):
    """``decode_pull``'s result and arrays (ids, rows, gains, segments, output_offsets), its
    blocks decoded in the calls ``parts`` (lists of block indices; default: one call)."""
    total = int(counts.sum())
    ids, rows, segments = (np.empty(total, np.int64) for _ in range(3))
    gains = np.empty(total, np.float32)
    offsets = np.empty(int(block_rows.sum()) + 1, np.int64)
    first_occ, first_row = _starts(counts), _starts(block_rows)
    bad = -1
    for part in parts or [list(range(len(counts)))]:
        got = sr.decode_pull(
            packed,
            at[part],
            counts[part],
            block_rows[part],
            first_occ[part],
            first_row[part],
            row,
            world,
            rank,
            n_rows,
            ids,
            rows,
            gains.view(np.int32),
            segments,
            offsets,
        )
        bad = got if bad < 0 else bad
    if not len(counts):
        offsets[0] = 0  # no block writes the end of an empty table's CSR
    return bad, ids, rows, gains, segments, offsets


@SETTINGS
@given(route=routes(), batch=table_batches())
def test_pull_packs_a_features_occurrences_for_their_owners(route, batch):
    world, row, owner = route
    ids, gains, segments, num_outputs, a, b, lo, hi = batch
    unique, inverse = dedup(ids)
    n = np.zeros(world, dtype=np.int64)
    m = np.zeros(world, dtype=np.int64)
    owners = owners_of(unique, world, row, owner)
    unique, inverse, segments, gains = map(read_only, (unique, inverse, segments, gains))
    sr.count_push(owners, inverse, segments, lo, hi, world, n, m)
    grad = np.zeros((b - a, 1), dtype=np.float32)
    want = push_reference(unique, inverse, segments, gains, lo, hi, a, grad, world, row, owner)
    # Blocks in reverse owner order, with gaps: the kernel must follow the offsets given.
    at = np.zeros(world, dtype=np.int64)
    target_at = np.zeros(world, dtype=np.int64)
    pp = pt = 1
    for d in reversed(range(world)):
        at[d], target_at[d] = pp, pt
        pp, pt = pp + 2 * n[d] + 2, pt + m[d] + 1
    packed = np.full(pp, -9, dtype=np.int64)
    targets = np.full(pt, -9, dtype=np.int64)
    sr.fill_pull(
        unique,
        owners,
        inverse,
        segments,
        gains.view(np.int32),
        lo,
        hi,
        world,
        packed,
        at,
        targets,
        target_at,
    )
    for d, (w_ids, w_at, w_gains, _) in enumerate(want):
        k = len(w_ids)
        pairs = packed[at[d] : at[d] + 2 * k].reshape(k, 2)
        np.testing.assert_array_equal(pairs[:, 0], w_ids)
        assert_packed(pairs[:, 1], w_at, w_gains)
        rows = segments[lo:hi][owners_of(unique[inverse[lo:hi]], world, row, owner) == d]
        np.testing.assert_array_equal(targets[target_at[d] : target_at[d] + m[d]], np.unique(rows))


@SETTINGS
@given(route=routes(), data=st.data())
def test_an_owner_pools_from_the_occurrences_and_updates_from_their_batch(route, data):
    world, row, _ = route
    rank, _, owned = _draw_owned(data, route, max_vocab=15)
    n_rows = int(local_rows(owned, world, row).max()) + 1 if len(owned) else 0
    # Blocks in the single engine's order (feature, sender), each pooled into its own rows.
    blocks, base = _draw_blocks(data, owned, in_order=True, gaps=False)
    # Laid out shuffled in the buffer, gains as fill_pull packs them.
    order = data.draw(st.permutations(range(len(blocks))))
    parts, starts, pos = [np.zeros(3, np.int64)], np.zeros(len(blocks), np.int64), 3
    for b in order:
        ids, at, gains, _, _ = blocks[b]
        pairs = np.stack([ids, pack(at, gains)], axis=1)
        parts.append(pairs.reshape(-1))
        starts[b], pos = pos, pos + 2 * len(ids)
    packed = np.concatenate(parts)
    counts = np.array([len(b[0]) for b in blocks], dtype=np.int64)
    block_rows = np.array([b[4] for b in blocks], dtype=np.int64)
    # In two calls, blocks out of order (an owner decodes the blocks it sent itself first).
    indices = list(range(len(counts)))
    first = data.draw(st.lists(st.sampled_from(indices), unique=True)) if indices else []
    parts = [first, [b for b in indices if b not in first]]
    bad, ids, rows, gains, segments, offsets = _decode(
        packed, starts, counts, block_rows, row, world, rank, n_rows, parts
    )
    want_ids, want_segments, want_gains = owner_batch_reference([b[:4] for b in blocks])
    assert bad == -1
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(rows, local_rows(want_ids, world, row))
    assert gains.tobytes() == want_gains.tobytes()
    # Each occurrence's row within its block; the CSR over all blocks' rows.
    within = np.concatenate([b[1] for b in blocks] + [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(segments, within)
    np.testing.assert_array_equal(offsets, csr(want_segments, base)[0])
    # The update's batch: the gradient rows arrive in another layout (blocks shuffled, gaps).
    grad_order = data.draw(st.permutations(range(len(blocks))))
    row_base, first = np.zeros(len(blocks), np.int64), data.draw(st.integers(0, 2))
    for b in grad_order:
        row_base[b], first = first, first + blocks[b][4] + data.draw(st.integers(0, 2))
    num_outputs = first
    out = _blocks_out(len(ids), num_outputs)
    del out["gains"]  # the kept gains serve the batch
    u = sr.kept_batch(
        ids,
        segments,
        gains,
        counts,
        block_rows,
        row_base,
        row,
        world,
        num_outputs,
        *out.values(),
    )
    moved = [(b[0], b[1], b[2], row_base[i]) for i, b in enumerate(blocks)]
    _, grad_rows, _ = owner_batch_reference(moved)
    _assert_owner_batch(out, u, want_ids, grad_rows, want_gains, num_outputs, world, row)


@pytest.mark.parametrize(
    ("pairs", "bad"),
    [
        ([(2, 0), (5, 1)], 1),  # id 5: neither rank 0's row (ids 0, 2, 4) nor in its 3 rows
        ([(2, 0), (4, 2)], 1),  # row 2 of a block of 2 rows
        ([(2, 1), (4, 0)], 1),  # rows go backwards: the bag order is broken
        ([(-1, 0)], 0),  # a negative id
    ],
)
@pytest.mark.parametrize("row", [sr.KIND_ROW, sr.KIND_TABLE])
def test_an_owner_refuses_occurrences_it_cannot_take(pairs, bad, row):
    packed = np.array([v for i, j in pairs for v in (i, (j << 32) | 0x3F800000)], np.int64)
    counts = np.array([len(pairs)], np.int64)
    got = _decode(packed, np.zeros(1, np.int64), counts, np.array([2]), row, 2, 0, 3)[0]
    assert got == bad
    # In a second block (the first good), the place counts the first block's occurrences.
    good = np.array([2, 0x3F800000], np.int64)
    got = _decode(
        np.concatenate([good, packed]),
        np.array([0, 2], np.int64),
        np.array([1, len(pairs)], np.int64),
        np.array([1, 2]),
        row,
        2,
        0,
        3,
    )[0]
    assert got == 1 + bad


@SETTINGS
@given(data=st.data())
def test_add_partials_stores_each_rows_first_sum_and_adds_the_others_in_rank_order(data):
    world = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(1, 3))
    n_out = data.draw(st.integers(1, 6))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    counts = np.zeros(world, np.int64)
    blocks = []
    for d in range(world):  # owner d pooled a sorted subset of the rows
        rows = np.flatnonzero(rng.random(n_out) < 0.6)
        counts[d] = len(rows)
        blocks.append((rows, rng.normal(size=(len(rows), dim)).astype(np.float32)))
    # Owners' blocks in reverse order in the buffers, with gaps.
    part_at, target_at = np.zeros(world, np.int64), np.zeros(world, np.int64)
    partials, targets = [np.zeros(1, np.float32)], [np.zeros(2, np.int64)]
    pp, pt = 1, 2
    for d in reversed(range(world)):
        part_at[d], target_at[d] = pp, pt
        partials.append(blocks[d][1].reshape(-1))
        targets.append(blocks[d][0])
        pp, pt = pp + counts[d] * dim, pt + counts[d]
    partials, targets = np.concatenate(partials), np.concatenate(targets)
    out = np.full((n_out, dim), np.nan, dtype=np.float32)
    out[:] = 0  # the engine's zeros: rows no owner pooled (empty bags)
    seen = np.zeros(n_out, np.uint8)
    sr.add_partials(out, partials, part_at, targets, target_at, counts, dim, seen)
    want = np.zeros((n_out, dim), np.float32)
    first = np.ones(n_out, bool)
    for rows, values in blocks:  # rank order, float32 arithmetic
        for r, v in zip(rows, values, strict=True):
            want[r] = v if first[r] else want[r] + v
            first[r] = False
    assert out.tobytes() == want.tobytes()
    np.testing.assert_array_equal(seen.astype(bool), ~first)


@SETTINGS
@given(data=st.data())
def test_rows_layout_views_aligned_blocks_and_copies_others(data):
    pytest.importorskip("torch")
    from embengine.distributed.engine import _RowsLayout

    dim = data.draw(st.integers(1, 4))
    n_blocks = data.draw(st.integers(0, 4))
    counts = np.array([data.draw(st.integers(0, 3)) for _ in range(n_blocks)], dtype=np.int64)
    gaps = [data.draw(st.sampled_from([0, dim, 2 * dim, 1])) for _ in range(n_blocks)]
    at, pos = [], 0
    for c, gap in zip(counts, gaps, strict=True):  # blocks in order, with gaps between
        pos += gap
        at.append(pos)
        pos += int(c) * dim
    buffer = np.arange(pos, dtype=np.float32)
    layout = _RowsLayout(np.array(at, dtype=np.int64), counts, dim)
    matrix = layout.matrix(buffer)
    for a, c, base in zip(at, counts, layout.row_base, strict=True):
        want = buffer[a : a + c * dim].reshape(-1, dim)
        np.testing.assert_array_equal(matrix[base : base + c], want)
    live = counts > 0
    aligned = not live.any() or all(
        (a - min(np.array(at)[live])) % dim == 0 for a, c in zip(at, counts, strict=True) if c
    )
    assert layout.view == aligned
    if aligned and live.any():
        assert np.shares_memory(matrix, buffer)  # read in place, not copied
    assert matrix.flags.c_contiguous and matrix.dtype == np.float32
