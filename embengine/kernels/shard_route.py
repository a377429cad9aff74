"""The bookkeeping of a sharded step (embengine.distributed), one pass per table or feature.

Who owns an id (``kind``, per table): under row sharding (``KIND_ROW``) id ``i`` lives on rank
``i mod W`` at local row ``i // W``; a whole table (``KIND_TABLE``) on rank ``owner`` at local
row ``i``; a keyed table's key ``k`` (``KIND_KEYED``) on rank ``mix64(k) mod W``, at the row its
owner's keyed table gives it (no arithmetic: ``owner_batch`` leaves it -1 for the caller).
``mix64`` is splitmix64's finaliser (Steele, Lea and Flood 2014): keys whose raw values share
their low bits, such as Monolith's FIDs (the slot in the high bits), still spread.

Pull (lookup): ``count_owners`` then ``route_ids`` split a table's unique ids by owner, in order
of first appearance within each owner's block, and give each unique id the row it will have in
the rows its owners send back (``row_base[d]`` + its place in owner d's block); the owner
answers with ``gather_rows``.

Push (update): ``owners_of`` (per unique id), then ``count_push`` and ``fill_push`` cut one
feature's occurrences by owner: per owner the ids, the index of each occurrence's gradient row
among those sent to that owner over its gain (16 bytes an occurrence, one all-to-all), and each
activation-gradient row once per owner that needs it (segments are
non-decreasing, so a row's occurrences are consecutive). ``owner_batch`` builds, from the
blocks an owner received, the TableBatch arrays the single engine would have built for its rows:
occurrences in the order of the blocks (the caller passes them in the single engine's order),
ids deduplicated in order of first appearance (``prepare._dedup``), grouped stably by unique id
(``prepare._csr``), so each row's gradient sums in the single engine's order.

"Sums" exchange (lookup; ``ShardedEngine(exchange=)``): ``count_push`` counts, ``fill_pull``
packs each occurrence for its owner (id; its activation row's index among those the owner
pools for the feature, and its gain), ``decode_pull`` checks and unpacks what an owner got into
arrays it pools its rows' part of every bag from (no deduplication: pooling needs none; block
by block, so that an owner pools the blocks it sent itself while the others travel),
``add_partials`` adds the owners' partial sums into the activations, and ``kept_batch`` builds
the update's TableBatch from the occurrences the owner kept (``owner_batch``'s arrays).

Ids here were validated by their rank's ``prepare``; what arrives over the wire is checked
against this rank's shard (a wrong owner or row is an error code, not an out-of-bounds read).
"""

from __future__ import annotations

import numpy as np

from . import kernel
from ._intrinsics import prefetch_row
from .prepare import _csr, _dedup, _offsets

# Ids ahead whose row ``gather_rows`` requests while it copies the current one: the rows asked
# for are scattered over the shard, so each is a cache miss without it.
GATHER_PREFETCH = 8


# Per table, how its ids map to ranks (``kind``; True and False work as ROW and TABLE).
KIND_TABLE, KIND_ROW, KIND_KEYED = 0, 1, 2


@kernel(inline="always")
def mix64(i):
    """splitmix64's finaliser of int64 ``i``, as uint64: a bijection whose every output bit
    depends on every input bit (``sharding.mix64`` is the NumPy twin)."""
    z = np.uint64(i)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@kernel(inline="always")
def owner_of(i, kind, owner, world):
    """The rank owning id ``i``."""
    if kind == KIND_ROW:
        return i % world
    if kind == KIND_KEYED:
        return np.int64(mix64(i) % np.uint64(world))
    return owner


@kernel(inline="always")
def local_row(i, kind, world):
    """The owner's row of id ``i`` (a keyed table's: -1, its keyed table knows it)."""
    if kind == KIND_ROW:
        return i // world
    if kind == KIND_KEYED:
        return -1
    return i


@kernel()
def count_owners(ids, kind, owner, world, counts):
    """``counts[d]`` += the number of ``ids`` rank d owns."""
    for k in range(ids.shape[0]):
        counts[owner_of(ids[k], kind, owner, world)] += 1


@kernel()
def route_ids(ids, kind, owner, world, send, send_at, rows, row_base):
    """Owner d's ids go to ``send[send_at[d]:]`` in order; ``rows[k]`` = ``row_base[d]`` + the
    place of ``ids[k]`` in d's block (where its row will be among the rows pulled back)."""
    placed = np.zeros(world, dtype=np.int64)
    for k in range(ids.shape[0]):
        d = owner_of(ids[k], kind, owner, world)
        send[send_at[d] + placed[d]] = ids[k]
        rows[k] = row_base[d] + placed[d]
        placed[d] += 1


@kernel()
def gather_rows(data, dim, ids, starts, stops, kind, world, rank, out, out_at):
    """Block b (ids ``starts[b]:stops[b]``, this rank's) answered with their rows' first
    ``dim`` floats, row after row, from ``out[out_at[b]]``. Returns -1, or the position in
    ``ids`` of an id this rank does not hold."""
    n_rows = data.shape[0]
    for b in range(starts.shape[0]):
        at = out_at[b]
        stop = stops[b]
        for k in range(starts[b], stop):
            if k + GATHER_PREFETCH < stop:
                ahead = local_row(ids[k + GATHER_PREFETCH], kind, world)
                if 0 <= ahead < n_rows:
                    prefetch_row(data, ahead, dim)
            i = ids[k]
            r = local_row(i, kind, world)
            if i < 0 or owner_of(i, kind, rank, world) != rank or r >= n_rows:
                return k
            for j in range(dim):
                out[at + j] = data[r, j]
            at += dim
    return -1


@kernel()
def owners_of(ids, kind, owner, world, out):
    """``out[k]``: the rank owning ``ids[k]`` (once per unique id, not per occurrence: the
    division by W costs more than the rest of an occurrence's bookkeeping)."""
    for k in range(ids.shape[0]):
        out[k] = owner_of(ids[k], kind, owner, world)


@kernel()
def count_push(owners, inverse, segments, lo, hi, world, n, m):
    """Occurrences ``lo:hi`` of a table batch (one feature's; ``owners``: per unique id):
    ``n[d]`` += those rank d owns, ``m[d]`` += the distinct activation rows among them."""
    last = np.full(world, -1, dtype=np.int64)
    for k in range(lo, hi):
        d = owners[inverse[k]]
        n[d] += 1
        if segments[k] != last[d]:
            m[d] += 1
            last[d] = segments[k]


@kernel()
def fill_push(
    unique_ids,
    owners,
    inverse,
    segments,
    gain_bits,
    lo,
    hi,
    out_start,
    grad,
    world,
    n,
    ints,
    int_at,
    rows_out,
    row_at,
):
    """Occurrences ``lo:hi`` (``n[d]`` of them owned by rank d, as ``count_push`` counted) into
    owner d's blocks: ids at ``ints[int_at[d]:]``, then, at ``ints[int_at[d] + n[d]:]``, each
    one's gradient-row index (among the rows sent to d for this feature) in the high 32 bits
    over its gain's float32 bits (``gain_bits``: the gains viewed as int32) in the low 32, as
    ``fill_pull`` packs them; activation-gradient rows (``grad[segment - out_start]``), once
    each, at ``rows_out[row_at[d]:]``."""
    dim = grad.shape[1]
    last = np.full(world, -1, dtype=np.int64)
    placed = np.zeros(world, dtype=np.int64)
    sent = np.zeros(world, dtype=np.int64)
    for k in range(lo, hi):
        u = inverse[k]
        d = owners[u]
        s = segments[k]
        if s != last[d]:
            at = row_at[d] + sent[d] * dim
            g = s - out_start
            for j in range(dim):
                rows_out[at + j] = grad[g, j]
            sent[d] += 1
            last[d] = s
        p = placed[d]
        ints[int_at[d] + p] = unique_ids[u]
        ints[int_at[d] + n[d] + p] = ((sent[d] - 1) << 32) | (np.int64(gain_bits[k]) & 0xFFFFFFFF)
        placed[d] = p + 1


@kernel()
def owner_batch(
    ints,
    int_at,
    counts,
    row_base,
    kind,
    world,
    rank,
    n_rows,
    num_outputs,
    unique,
    inverse,
    gains,
    segments,
    unique_rows,
    output_offsets,
    unique_offsets,
    unique_gains,
    unique_segments,
):
    """One table's occurrences received by its owner, block after block (block b: ``counts[b]``
    ids at ``ints[int_at[b]:]``, then their gradient-row indices over their gains' bits as
    ``fill_push`` packs them, gradient rows from ``row_base[b]``), as a TableBatch's arrays:
    ``gains`` (int32 views of the float32 arrays: the bits are copied), ``segments``
    (gradient rows) in block order; ``unique`` ids in order of first appearance with
    ``inverse``, their local ``unique_rows``; the CSR views ``output_offsets`` (over
    ``num_outputs`` gradient rows) and, grouped stably by unique id, ``unique_offsets``,
    ``unique_gains``, ``unique_segments``. Returns the number of unique ids, or -1 - k for an
    occurrence k whose id this rank does not hold (or whose gradient row is out of range)."""
    total = 0
    for b in range(counts.shape[0]):
        total += counts[b]
    ids = np.empty(total, dtype=np.int64)
    k = 0
    for b in range(counts.shape[0]):
        c = counts[b]
        for p in range(c):
            i = ints[int_at[b] + p]
            v = ints[int_at[b] + c + p]
            s = row_base[b] + (v >> 32)
            if (
                (i < 0 and kind != KIND_KEYED)
                or owner_of(i, kind, rank, world) != rank
                or local_row(i, kind, world) >= n_rows
                or s < 0
                or s >= num_outputs
            ):
                return -1 - k
            ids[k] = i
            segments[k] = s
            gains[k] = np.int32(v & 0xFFFFFFFF)
            k += 1
    return _grouped(
        ids,
        segments,
        gains,
        kind,
        world,
        num_outputs,
        unique,
        inverse,
        unique_rows,
        output_offsets,
        unique_offsets,
        unique_gains,
        unique_segments,
    )


@kernel()
def _grouped(
    ids,
    segments,
    gains,
    kind,
    world,
    num_outputs,
    unique,
    inverse,
    unique_rows,
    output_offsets,
    unique_offsets,
    unique_gains,
    unique_segments,
):
    """The TableBatch arrays of an owner's occurrences (``ids``, ``segments``, ``gains`` in
    the single engine's order): ``unique`` ids in order of first appearance with ``inverse``,
    their local ``unique_rows``, the CSR views by output and, grouped stably by unique id, by
    row. Returns the number of unique ids. ``gains`` may be float32 or its int32 bits (copied
    as they are)."""
    total = ids.shape[0]
    run_bounds = np.array([0, total], dtype=np.int64)
    regions = np.zeros(1, dtype=np.int64)
    ends = np.zeros(1, dtype=np.int64)
    u = _dedup(ids, unique, inverse, run_bounds, regions, ends)
    for q in range(u):
        unique_rows[q] = local_row(unique[q], kind, world)
    _offsets(segments, num_outputs, output_offsets)
    by_unique = np.empty(total, dtype=np.int64)
    _csr(inverse, u, unique_offsets, by_unique)
    for p in range(total):
        unique_gains[p] = gains[by_unique[p]]
        unique_segments[p] = segments[by_unique[p]]
    return u


@kernel()
def fill_pull(
    unique_ids,
    owners,
    inverse,
    segments,
    gain_bits,
    lo,
    hi,
    world,
    packed,
    at,
    targets,
    target_at,
):
    """Occurrences ``lo:hi`` of a table batch (one feature's) into owner d's block of the
    "sums" exchange: two int64 each from ``packed[at[d]]``, the id, then the index of its
    activation row among the rows d pools for this feature (the high 32 bits) over its gain's
    float32 bits (``gain_bits``: the gains viewed as int32; the low 32 bits).
    ``targets[target_at[d] + j]``: the activation row (segment) of the j-th row owner d pools
    for this feature, where its partial sum goes and whose gradient the update sends d."""
    last = np.full(world, -1, dtype=np.int64)
    placed = np.zeros(world, dtype=np.int64)
    sent = np.zeros(world, dtype=np.int64)
    for k in range(lo, hi):
        u = inverse[k]
        d = owners[u]
        s = segments[k]
        if s != last[d]:
            targets[target_at[d] + sent[d]] = s
            sent[d] += 1
            last[d] = s
        p = at[d] + 2 * placed[d]
        packed[p] = unique_ids[u]
        packed[p + 1] = ((sent[d] - 1) << 32) | (np.int64(gain_bits[k]) & 0xFFFFFFFF)
        placed[d] += 1


@kernel()
def decode_pull(
    packed,
    at,
    counts,
    block_rows,
    first_occ,
    first_row,
    kind,
    world,
    rank,
    n_rows,
    ids,
    rows,
    gain_bits,
    segments,
    output_offsets,
):
    """Blocks of one table's occurrences received by its owner in a "sums" lookup
    (``fill_pull``'s pairs; block b: ``counts[b]`` pairs from ``packed[at[b]]``, pooled into
    ``block_rows[b]`` rows), as arrays a pooling kernel reads: occurrence p of block b goes to
    place ``first_occ[b] + p`` of each occurrence's id, local row, gain (int32 bits) and
    activation row in its block (``segments``: its index among the block's rows), and the
    block's rows get their CSR in ``output_offsets[first_row[b]:first_row[b] + block_rows[b] + 1]``
    (places, not counts). Returns -1, or the place of an occurrence whose id this rank does
    not hold or whose row index is out of its block or smaller than the one before it."""
    for b in range(counts.shape[0]):
        previous = 0
        filled = 0  # the block's rows whose first place is written
        base = first_row[b]
        for p in range(counts[b]):
            k = first_occ[b] + p
            i = packed[at[b] + 2 * p]
            v = packed[at[b] + 2 * p + 1]
            j = v >> 32
            r = local_row(i, kind, world)
            if (
                (i < 0 and kind != KIND_KEYED)
                or owner_of(i, kind, rank, world) != rank
                or r >= n_rows
                or j < previous
                or j >= block_rows[b]
            ):
                return k
            previous = j
            while filled <= j:
                output_offsets[base + filled] = k
                filled += 1
            ids[k] = i
            rows[k] = r
            gain_bits[k] = np.int32(v & 0xFFFFFFFF)
            segments[k] = j
        while filled <= block_rows[b]:
            output_offsets[base + filled] = first_occ[b] + counts[b]
            filled += 1
    return -1


@kernel()
def kept_batch(
    ids,
    segments,
    gains,
    counts,
    block_rows,
    row_base,
    kind,
    world,
    num_outputs,
    unique,
    inverse,
    grad_rows,
    unique_rows,
    output_offsets,
    unique_offsets,
    unique_gains,
    unique_segments,
):
    """The update's TableBatch arrays of the occurrences an owner kept from a "sums" lookup
    (``decode_pull``'s ``ids``, ``segments``, ``gains``, blocks of ``counts[b]`` occurrences
    over ``block_rows[b]`` rows, segments counted within the block): their activation rows
    moved to the gradient rows that arrived for them (block b's from row ``row_base[b]`` of
    the ``num_outputs`` received, as ``grad_rows``), then ``owner_batch``'s dedup and CSR
    views. Returns the number of unique ids."""
    k = 0
    for b in range(counts.shape[0]):
        for _ in range(counts[b]):
            grad_rows[k] = segments[k] + row_base[b]
            k += 1
    return _grouped(
        ids,
        grad_rows,
        gains,
        kind,
        world,
        num_outputs,
        unique,
        inverse,
        unique_rows,
        output_offsets,
        unique_offsets,
        unique_gains,
        unique_segments,
    )


@kernel()
def add_partials(out, partials, part_at, targets, target_at, counts, dim, seen):
    """One feature's partial sums from its owners, in rank order, into its activation rows:
    owner d's j-th row (``dim`` floats from ``partials[part_at[d] + j * dim]``) goes to row
    ``targets[target_at[d] + j]`` of ``out``, stored when it is the row's first (``seen``)
    and added otherwise, so a bag whose ids all live on one rank gets its owner's sum bit for
    bit."""
    for d in range(counts.shape[0]):
        for j in range(counts[d]):
            o = targets[target_at[d] + j]
            a = part_at[d] + j * dim
            if seen[o]:
                for c in range(dim):
                    out[o, c] += partials[a + c]
            else:
                for c in range(dim):
                    out[o, c] = partials[a + c]
                seen[o] = 1
