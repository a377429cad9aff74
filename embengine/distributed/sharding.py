"""Which rank owns which row of a sharded table, and a rank's share of a table (``ShardTable``).

Two kinds, per logical table:

- ``"row"``: id ``r`` lives on rank ``r mod W``, at local row ``r // W`` (hot rows, which are
  usually small ids, spread over every rank);
- ``"table"``: the whole table on one rank (local row = id), tables given to ranks largest
  first, each to the rank holding the fewest bytes so far (ties: the lowest rank);
- ``"keyed"``: a keyed table (``vocabulary_size=None``, a dynamic vocabulary), whatever was
  asked: key ``k`` lives on rank ``mix64(k) mod W`` (``mix64``: splitmix64's finaliser, not the
  raw key, whose low bits may all be alike: Monolith's FIDs carry their slot in the high bits),
  in that rank's own ``KeyedTable``;
- ``"auto"``: per table, by its size and its expected traffic (``plan_auto``): ``"row"`` for a
  table whose optimizer updates every row, or that would hold more than half a rank's fair
  share of the bytes or of the expected traffic if whole on one rank; every other table whole,
  the busiest first to the rank with the least expected traffic so far. ``ShardPlan.reasons``
  says why, per table.

What crosses the wire for a table each step (``exchange=``, ``plan_exchange``) is a choice of its
own: ``"rows"`` (each rank pulls the rows of its unique ids and pools its bags itself; lookups
bit-identical to the single engine's), ``"sums"`` (each rank sends the owners its occurrences,
each owner pools its rows' part of every bag and sends these partial sums back, and keeps the
occurrences for the update, which then sends only gradient rows), or ``"auto"`` (per step,
whichever sends fewer bytes by ``sums_saving``, from every rank's counts). Keyed tables
exchange rows; a whole table (``"table"``) under ``"auto"`` exchanges sums, whose ranks send
their occurrences undeduplicated (docs/design.md, "A whole table exchanges sums").

A rank's share is a ``ShardTable``: a DenseTable over the ids it owns, whose ``rows_for`` maps
global ids to local rows (``NO_ROW``, -1, for another rank's id) and whose rows start with the
values the single-process engine gives those ids (initializers are pure functions of (seed,
table, id)), so a sharded table is the single engine's table cut by rows.

No torch here: the plan is pure and testable without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..initializers import Initializer
from ..optimizers import SlotSpec
from ..precision import check_initial, check_initial_slots
from ..storage import DenseTable
from ..storage.protocol import NO_ROW

__all__ = [
    "EXCHANGE_CHOICES",
    "SHARDING_KINDS",
    "ShardPlan",
    "ShardTable",
    "TableLoad",
    "UpdateMessage",
    "expected_traffic",
    "message_grid",
    "mix64",
    "plan_auto",
    "plan_exchange",
    "plan_shards",
    "sums_saving",
    "update_message",
]

SHARDING_KINDS = ("row", "table")
# What a keyed table gets, whatever ``sharding=`` asks (its rows are keys, not ids a rank can
# compute): owners by ``mix64(key) mod W``.
KEYED = "keyed"
KEYED_REASON = "keyed: key k on rank mix64(k) mod W (keys spread whatever their bits)"
# What ``sharding=`` takes per table: a kind, or "auto" (the plan picks one).
SHARDING_CHOICES = (*SHARDING_KINDS, "auto")
# "auto" shards a table by row when, whole, it would take more than this share of one rank's
# fair share (1 / W of every table's) of the bytes or of the expected traffic.
AUTO_SHARE = 0.5


# What ``exchange=`` takes per table (see the module docstring).
EXCHANGE_CHOICES = ("rows", "sums", "auto")


def per_table(
    value: str | Mapping[str, str],
    what: str,
    choices: Sequence[str],
    default: str,
    table_names: Sequence[str],
) -> list[str]:
    """Per table, the kind ``value`` gives it: one of ``choices`` for every table, or a dict
    table name -> one of them (tables not named get ``default``); errors name ``what``."""
    if isinstance(value, str):
        if value not in choices:
            raise ValueError(f"{what} must be one of {tuple(choices)} or a dict, got {value!r}")
        return [value] * len(table_names)
    if isinstance(value, Mapping):
        unknown = [t for t in value if t not in table_names]
        if unknown:
            raise ValueError(
                f"{what} names unknown tables {unknown}; tables are {list(table_names)}"
            )
        for t, k in value.items():
            if k not in choices:
                raise ValueError(f"{what}[{t!r}] must be one of {tuple(choices)}, got {k!r}")
        return [value.get(t, default) for t in table_names]
    raise TypeError(f"{what} must be a str or a dict of table -> kind, got {value!r}")


def plan_exchange(
    exchange: str | Mapping[str, str],
    table_names: Sequence[str],
    keyed: Sequence[bool],
    whole: Sequence[bool] | None = None,
) -> tuple[str, ...]:
    """Per table, ``"rows"``, ``"sums"`` or ``"auto"``, from ``exchange`` (one of them, or a
    dict table name -> one of them; tables not named are "auto"). A keyed table exchanges
    rows (its owner resolves keys to rows once per step, before anyone pools): "auto" gives it
    "rows", and "sums" asked for it by name is a ValueError. A whole table (``whole[t]``: the
    plan puts it on one rank) exchanges "sums" under "auto": a rank then sends its
    occurrences as they come, without deduplicating them, where weighing the exchanges each
    step needs every rank's unique ids, a deduplication the owner repeats anyway."""
    kinds = per_table(exchange, "exchange", EXCHANGE_CHOICES, "auto", table_names)
    for t, name in enumerate(table_names):
        if whole is not None and whole[t] and not keyed[t] and kinds[t] == "auto":
            kinds[t] = "sums"
        if keyed[t] and kinds[t] == "sums" and isinstance(exchange, Mapping):
            raise ValueError(
                f'exchange[{name!r}] = "sums": table {name!r} is keyed, and a keyed table '
                'exchanges rows (its owner resolves the keys first); leave it "rows" or "auto"'
            )
        if keyed[t]:
            kinds[t] = "rows"
    return tuple(kinds)


# The widest block grid (floats) of a speculating update's message (``message_grid``).
GRID_LIMIT = 4096


def message_grid(dims) -> int:
    """The grid (floats) a speculating update's blocks start on and end on (``update_message``):
    the least common multiple of 2 (int64 words on 8 bytes) and every table's row width
    ``dims``, so that each table's gradient rows can be a view of what arrived; 2 where that
    multiple passes ``GRID_LIMIT`` (the rows are then copied into place)."""
    grid = int(np.lcm.reduce([2, *(int(d) for d in dims)]))
    return grid if grid <= GRID_LIMIT else 2


@dataclass(frozen=True)
class UpdateMessage:
    """Where the parts of a speculating update's all-to-all lie (``update_message``), in
    float32 words of the buffer: per peer its block's size and start; per [peer, feature]
    where the feature's gradient rows start (floats) and its occurrences (int64 words)."""

    sizes: np.ndarray
    block_at: np.ndarray
    row_at: np.ndarray
    int_at: np.ndarray


def update_message(
    occurrences: np.ndarray,
    gradient_rows: np.ndarray,
    feature_dims: np.ndarray,
    header_words: int,
    grid: int,
) -> UpdateMessage:
    """The layout of the all-to-all an update right after its lookup sends in (ShardedEngine:
    header and data at once), ``occurrences`` pushed and ``gradient_rows`` per [feature, peer]
    (features of widths ``feature_dims``). Each peer's block, from a multiple of ``grid``
    (``message_grid``) floats: the header (``header_words`` int64) padded to the grid; each
    feature's gradient rows, from a multiple of its width within the block; a float of padding
    if needed for 8 bytes; the occurrences (2 int64 each) feature by feature; padding to the
    grid. So a table's rows from every peer lie on one grid of its width (a view,
    ``_RowsLayout``) when ``grid`` is a multiple of it, and the int64 words on 8 bytes."""
    n = np.asarray(occurrences, dtype=np.int64)
    m = np.asarray(gradient_rows, dtype=np.int64)
    dims = np.asarray(feature_dims, dtype=np.int64)
    features, peers = m.shape
    pos = np.full(peers, -(-2 * header_words // grid) * grid, dtype=np.int64)
    row_at = np.empty((peers, features), dtype=np.int64)
    for f in range(features):
        pos = -(-pos // dims[f]) * dims[f]
        row_at[:, f] = pos
        pos = pos + m[f] * dims[f]
    pos = pos + (pos & 1)
    two = 2 * n.T
    int_at = (pos // 2)[:, None] + np.cumsum(two, axis=1) - two
    sizes = -(-(pos + 4 * n.sum(axis=0)) // grid) * grid
    block_at = np.zeros(peers, dtype=np.int64)
    np.cumsum(sizes[:-1], out=block_at[1:])
    return UpdateMessage(
        sizes, block_at, row_at + block_at[:, None], int_at + block_at[:, None] // 2
    )


def sums_saving(dim: int, remote_ids: int, gradient_rows: int, value_bytes: int = 4) -> int:
    """Bytes one rank sends in a step of one table under "rows" minus under "sums", by the
    cost model of docs/design.md: ``remote_ids``, its unique ids owned by other ranks (R);
    ``gradient_rows``, its (activation row, other owner) pairs (G); N, the occurrences of its
    ids owned elsewhere; ``value_bytes`` (b), a weight's stored bytes (4, or 2 for a 16-bit
    table, whose pulled rows travel as stored)::

        rows: (8 + b dim) R + 16 N + 4 dim G    (ids and pulled rows; occurrences and
                                                 gradient rows pushed in the update)
        sums: 16 N + 8 dim G                    (occurrences; partial sums back, gradient
                                                 rows in the update)

    An occurrence costs 16 bytes either way (its id; its activation row's index over its
    gain), so the saving, ``(8 + b dim) R - 4 dim G``, does not depend on N.

    (a rank answers others' ids and partial sums as they answer its own, so summed over the
    ranks this is the step's saving.) "auto" takes "sums" when the ranks' savings add up to
    zero or more: ties (nothing remote, e.g. one rank) go to "sums", whose owners pool from
    their own rows without copying them."""
    d = int(dim)
    return (8 + int(value_bytes) * d) * int(remote_ids) - 4 * d * int(gradient_rows)


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of int64 ``keys``, as uint64 (``kernels.shard_route.mix64``'s
    NumPy twin; the owner of a keyed table's key ``k`` is ``mix64(k) % W``)::

        z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31

    (arithmetic mod 2^64)."""
    z = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class ShardPlan:
    """Per logical table (engine order): its kind and, for ``"table"``, its owner rank.

    Attributes:
      world_size: W, the ranks of the engine's process group.
      kinds: ``"row"`` or ``"table"`` per table.
      owners: the owner rank of a ``"table"`` table; -1 for a ``"row"`` one.
    """

    world_size: int
    kinds: tuple[str, ...]
    owners: tuple[int, ...]
    reasons: tuple[str, ...] = ()  # per table, why "auto" chose its kind (empty: not auto)

    def owner_of(self, table: int, ids: np.ndarray) -> np.ndarray:
        """The rank owning each of ``ids`` (int64) of logical table ``table``."""
        if self.kinds[table] == "row":
            return ids % self.world_size
        if self.kinds[table] == KEYED:
            return (mix64(ids) % np.uint64(self.world_size)).astype(np.int64)
        return np.full(len(ids), self.owners[table], dtype=np.int64)

    def owned_ids(self, table: int, vocabulary_size: int, rank: int) -> np.ndarray:
        """The ids of ``table`` that ``rank`` owns, ascending (its local rows in order)."""
        if self.kinds[table] == "row":
            return np.arange(rank, vocabulary_size, self.world_size, dtype=np.int64)
        if self.owners[table] == rank:
            return np.arange(vocabulary_size, dtype=np.int64)
        return np.zeros(0, dtype=np.int64)

    def describe(self, table_names: Sequence[str]) -> dict[str, str]:
        """Table name -> "row", "keyed" or "table on rank k" (for ``ShardedEngine.plan``); a
        table that "auto" placed: its reason, e.g. "row: 1000000 rows x 64, hot ids spread
        (...)", "table: 100 rows x 8, on rank 1 (...)" or "keyed: key k on rank mix64(k) mod
        W (...)"."""
        return {
            name: (
                self.reasons[t]
                if self.reasons and self.reasons[t]
                else kind
                if kind in ("row", KEYED)
                else f"table on rank {owner}"
            )
            for t, (name, kind, owner) in enumerate(
                zip(table_names, self.kinds, self.owners, strict=True)
            )
        }


@dataclass(frozen=True)
class TableLoad:
    """What "auto" weighs for one table: its shape, the bytes of its weights and slots, its
    expected traffic (bytes a step per id slot of a sample, see ``expected_traffic``) and
    whether its optimizer updates every row each step."""

    rows: int
    dim: int
    nbytes: int
    traffic: float
    every_row: bool = False


def expected_traffic(dim: int, positions: Sequence[int], value_bytes: int = 4) -> float:
    """A table's expected bytes on the wire a step, per sample, by the cost model of
    docs/design.md with one id per bag or sequence position (the data is not known when the
    plan is made): per id, one pulled row and its id (``8 + b dim``, ``b`` = ``value_bytes``,
    a weight's stored bytes: 4, or 2 for a 16-bit table, whose pulled rows travel as stored),
    one pushed occurrence (20) and its share of a gradient row (``4 dim``, float32 whatever
    the table stores). ``positions``: per feature of the table, its ids a sample (1 for a bag,
    ``max_sequence_length`` for a sequence feature)."""
    return float(sum(positions)) * (28 + (4 + int(value_bytes)) * dim)


def plan_auto(
    loads: Sequence[TableLoad], world_size: int
) -> tuple[list[str], list[int], list[str]]:
    """Kinds, owners and reasons of "auto" for tables ``loads`` on ``world_size`` ranks.

    Row sharding, in this order, for a table whose optimizer updates every row (each rank then
    sweeps 1 / W of it a step), whose bytes exceed ``AUTO_SHARE`` of one rank's fair share
    (every table's bytes / W), or whose expected traffic exceeds ``AUTO_SHARE`` of one rank's
    fair share of the traffic (hot ids spread over every rank). Every other table whole on one
    rank (its per-table work, the answer and the update, done once and by one rank), the
    busiest first (ties: the larger, then the first) to the rank with the least expected
    traffic so far (ties: the fewest bytes, the lowest rank)."""
    w = int(world_size)
    total_bytes = sum(t.nbytes for t in loads)
    total_traffic = sum(t.traffic for t in loads)
    kinds, owners, reasons = ["row"] * len(loads), [-1] * len(loads), [""] * len(loads)
    whole = []
    for i, t in enumerate(loads):
        shape = f"{t.rows} rows x {t.dim}"
        byte_share = t.nbytes / total_bytes if total_bytes else 0.0
        traffic_share = t.traffic / total_traffic if total_traffic else 0.0
        if w > 1 and t.every_row:
            reasons[i] = f"row: {shape}, its optimizer updates every row: each rank sweeps 1/{w}"
        elif w > 1 and byte_share * w > AUTO_SHARE:
            reasons[i] = (
                f"row: {shape}, {100 * byte_share:.0f}% of the bytes: more than "
                f"{AUTO_SHARE:g} of a rank's share whole"
            )
        elif w > 1 and traffic_share * w > AUTO_SHARE:
            reasons[i] = (
                f"row: {shape}, hot ids spread ({100 * traffic_share:.0f}% of the expected traffic)"
            )
        else:
            whole.append(i)
    traffic, held = [0.0] * w, [0] * w
    for i in sorted(whole, key=lambda i: (-loads[i].traffic, -loads[i].nbytes, i)):
        rank = min(range(w), key=lambda r: (traffic[r], held[r], r))
        kinds[i], owners[i] = "table", rank
        traffic[rank] += loads[i].traffic
        held[rank] += loads[i].nbytes
        share = loads[i].traffic / total_traffic if total_traffic else 0.0
        reasons[i] = (
            f"table: {loads[i].rows} rows x {loads[i].dim}, on rank {rank} "
            f"({100 * share:.0f}% of the expected traffic)"
        )
    return kinds, owners, reasons


def plan_shards(
    sharding: str | Mapping[str, str],
    table_names: Sequence[str],
    table_bytes: Sequence[int],
    world_size: int,
    loads: Sequence[TableLoad] | None = None,
    keyed: Sequence[bool] | None = None,
) -> ShardPlan:
    """The shard plan of tables ``table_names`` (``table_bytes``: each one's weights and slots)
    for ``sharding`` ("row", "table", "auto", or a dict table name -> one of them; tables not
    named are "row"). "table" tables go largest first to the rank with the fewest bytes so far;
    "auto" ones are placed by ``plan_auto`` (which needs ``loads``, per table), among
    themselves. A keyed table (``keyed[t]``) is ``"keyed"`` whatever ``sharding`` says (its
    reason under "auto" says so); it takes no part in the placement of the others."""
    keyed = list(keyed) if keyed is not None else [False] * len(table_names)
    kinds = per_table(sharding, "sharding", SHARDING_CHOICES, "row", table_names)
    owners = [-1] * len(table_names)
    reasons = [""] * len(table_names)
    auto = [t for t, k in enumerate(kinds) if k == "auto" and not keyed[t]]
    if auto:
        if loads is None:
            raise ValueError('sharding "auto" needs each table\'s load (loads=)')
        a_kinds, a_owners, a_reasons = plan_auto([loads[t] for t in auto], world_size)
        for t, k, o, why in zip(auto, a_kinds, a_owners, a_reasons, strict=True):
            kinds[t], owners[t], reasons[t] = k, o, why
    for t in range(len(table_names)):
        if keyed[t]:
            kinds[t], owners[t], reasons[t] = KEYED, -1, KEYED_REASON
    load = [0] * world_size
    whole = sorted(
        (t for t, k in enumerate(kinds) if k == "table" and owners[t] < 0),
        key=lambda t: (-table_bytes[t], t),
    )
    for t in whole:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[t] = rank
        load[rank] += table_bytes[t]
    said = any(
        k == "auto" for k in (sharding.values() if isinstance(sharding, Mapping) else [sharding])
    )
    return ShardPlan(int(world_size), tuple(kinds), tuple(owners), tuple(reasons) if said else ())


class ShardTable(DenseTable):
    """A rank's rows of one logical table: row ``i`` holds global id ``ids[i]`` (ascending),
    ``[weights | slots]`` as DenseTable lays them out (``weights_dtype`` / ``slots_dtype``:
    16-bit rows too), initialised as the single engine initialises that id. ``rows_for`` maps
    global ids to local rows: row sharding ``id // W`` for this rank's ids, the id itself for
    a whole table, ``NO_ROW`` for another rank's id. A 16-bit update rounds row ``i`` with
    the stream of id ``ids[i]`` (``rounding_rows``), as the single engine rounds that id's row:
    the same bits at any world size."""

    def __init__(
        self,
        name: str,
        vocabulary_size: int,
        dim: int,
        slot_specs: tuple[SlotSpec, ...],
        initializer: Initializer,
        seed: int,
        ids: np.ndarray,
        world_size: int,
        rank: int,
        kind: str,
        weights_dtype: str = "float32",
        slots_dtype: str = "float32",
        path: str | os.PathLike | None = None,
    ):
        self.global_ids = np.asarray(ids, dtype=np.int64)  # read by _initialise
        self.global_vocabulary_size = int(vocabulary_size)
        self.world_size, self.rank, self.kind = int(world_size), int(rank), kind
        super().__init__(
            name,
            len(self.global_ids),
            dim,
            slot_specs,
            initializer,
            seed,
            path=path,
            weights_dtype=weights_dtype,
            slots_dtype=slots_dtype,
        )

    def _initialise(
        self, initializer: Initializer, seed: int, name: str, first: int, count: int
    ) -> None:
        # DenseTable initialises local row r as id r; a shard's row r holds global_ids[r].
        chunk, whole = max(1, (1 << 22) // max(self.dim, 1)), None
        if initializer.whole_table:  # the whole table's values, as one process has them
            every = np.arange(self.global_vocabulary_size, dtype=np.int64)
            chunk, whole = max(count, 1), initializer.init(seed, name, every, self.dim)
        if count:  # as DenseTable's
            check_initial_slots(name, self.slots_dtype, self.slot_specs)
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            ids = self.global_ids[first + lo : first + hi]
            values = initializer.init(seed, name, ids, self.dim) if whole is None else whole[ids]
            # a 16-bit column's view rounds to nearest, as DenseTable's initial values (and
            # as there, a value past its range is refused, not stored as Inf)
            check_initial(name, self.weights_dtype, values, "its initializer", ids=ids)
            self.weights[first + lo : first + hi] = values
            for spec in self.slot_specs:
                self.slot(spec.name)[first + lo : first + hi] = spec.initial_value

    @property
    def rounding_rows(self) -> np.ndarray:
        """What a 16-bit update's rounding stream follows for each row (``rounding.hash_row``,
        ``precision.rounding_places``): its global id. The single engine's stream follows its
        rows, which are its ids, so a shard rounds every id as one process does. Row sharding:
        ``[[W, rank, 0]]``, id ``r W + rank`` computed (a table of ids read at each updated
        row cost a cache miss a row: twice the update's time); a whole table: none (its rows
        are its ids)."""
        if self.kind == "row":
            return np.array([[self.world_size, self.rank, 0]], dtype=np.int64)
        return np.zeros((0, 1), dtype=np.int64)

    @property
    def row_bases(self) -> tuple[int, ...] | None:
        """(0,) when local rows are the ids (a whole table, or W = 1), else None."""
        if self.kind == "table" or self.world_size == 1:
            return (0,) if len(self.global_ids) == self.global_vocabulary_size else None
        return None

    def rows_for(self, logical: int, ids: np.ndarray, insert: bool = True) -> np.ndarray:
        """Local rows of global ``ids``; ``NO_ROW`` for ids another rank owns."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.kind == "row":
            return np.where(ids % self.world_size == self.rank, ids // self.world_size, NO_ROW)
        if len(self.global_ids):
            return ids.copy()
        return np.full(len(ids), NO_ROW, dtype=np.int64)
