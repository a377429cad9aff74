"""Which rank owns which row of a sharded table, and a rank's share of a table (``ShardTable``).

Two kinds, per logical table:

- ``"row"``: id ``r`` lives on rank ``r mod W``, at local row ``r // W`` (hot rows, which are
  usually small ids, spread over every rank);
- ``"table"``: the whole table on one rank (local row = id), tables given to ranks largest
  first, each to the rank holding the fewest bytes so far (ties: the lowest rank).

A rank's share is a ``ShardTable``: a DenseTable over the ids it owns, whose ``rows_for`` maps
global ids to local rows (``NO_ROW``, -1, for another rank's id) and whose rows start with the
values the single-process engine gives those ids (initializers are pure functions of (seed,
table, id)), so a sharded table is the single engine's table cut by rows.

No torch here: the plan is pure and testable without a process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..initializers import Initializer
from ..optimizers import SlotSpec
from ..storage import DenseTable
from ..storage.protocol import NO_ROW

__all__ = ["SHARDING_KINDS", "ShardPlan", "ShardTable", "plan_shards"]

SHARDING_KINDS = ("row", "table")


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

    def owner_of(self, table: int, ids: np.ndarray) -> np.ndarray:
        """The rank owning each of ``ids`` (int64) of logical table ``table``."""
        if self.kinds[table] == "row":
            return ids % self.world_size
        return np.full(len(ids), self.owners[table], dtype=np.int64)

    def owned_ids(self, table: int, vocabulary_size: int, rank: int) -> np.ndarray:
        """The ids of ``table`` that ``rank`` owns, ascending (its local rows in order)."""
        if self.kinds[table] == "row":
            return np.arange(rank, vocabulary_size, self.world_size, dtype=np.int64)
        if self.owners[table] == rank:
            return np.arange(vocabulary_size, dtype=np.int64)
        return np.zeros(0, dtype=np.int64)

    def describe(self, table_names: Sequence[str]) -> dict[str, str]:
        """Table name -> "row" or "table on rank k" (for ``ShardedEngine.plan``)."""
        return {
            name: kind if kind == "row" else f"table on rank {owner}"
            for name, kind, owner in zip(table_names, self.kinds, self.owners, strict=True)
        }


def plan_shards(
    sharding: str | Mapping[str, str],
    table_names: Sequence[str],
    table_bytes: Sequence[int],
    world_size: int,
) -> ShardPlan:
    """The shard plan of tables ``table_names`` (``table_bytes``: each one's weights and slots)
    for ``sharding`` ("row", "table", or a dict table name -> either; tables not named are
    "row"). "table" tables go largest first to the rank with the fewest bytes so far."""
    if isinstance(sharding, str):
        if sharding not in SHARDING_KINDS:
            raise ValueError(
                f"sharding must be one of {SHARDING_KINDS} or a dict, got {sharding!r}"
            )
        kinds = [sharding] * len(table_names)
    elif isinstance(sharding, Mapping):
        unknown = [t for t in sharding if t not in table_names]
        if unknown:
            raise ValueError(
                f"sharding names unknown tables {unknown}; tables are {list(table_names)}"
            )
        for t, k in sharding.items():
            if k not in SHARDING_KINDS:
                raise ValueError(f"sharding[{t!r}] must be one of {SHARDING_KINDS}, got {k!r}")
        kinds = [sharding.get(t, "row") for t in table_names]
    else:
        raise TypeError(f"sharding must be a str or a dict of table -> kind, got {sharding!r}")
    owners = [-1] * len(table_names)
    load = [0] * world_size
    whole = sorted((t for t, k in enumerate(kinds) if k == "table"),
                   key=lambda t: (-table_bytes[t], t))  # fmt: skip
    for t in whole:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[t] = rank
        load[rank] += table_bytes[t]
    return ShardPlan(int(world_size), tuple(kinds), tuple(owners))


class ShardTable(DenseTable):
    """A rank's rows of one logical table: row ``i`` holds global id ``ids[i]`` (ascending),
    ``[weights | slots]`` as DenseTable lays them out, initialised as the single engine
    initialises that id. ``rows_for`` maps global ids to local rows: row sharding ``id // W``
    for this rank's ids, the id itself for a whole table, ``NO_ROW`` for another rank's id."""

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
    ):
        self.global_ids = np.asarray(ids, dtype=np.int64)  # read by _initialise
        self.global_vocabulary_size = int(vocabulary_size)
        self.world_size, self.rank, self.kind = int(world_size), int(rank), kind
        super().__init__(name, len(self.global_ids), dim, slot_specs, initializer, seed)

    def _initialise(self, initializer: Initializer, seed: int, name: str, first: int,
                    count: int) -> None:  # fmt: skip
        # DenseTable initialises local row r as id r; a shard's row r holds global_ids[r].
        chunk = max(1, (1 << 22) // max(self.dim, 1))
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            values = initializer.init(seed, name, self.global_ids[first + lo : first + hi],
                                      self.dim)  # fmt: skip
            self.data[first + lo : first + hi, : self.dim] = values
            for spec in self.slot_specs:
                self.slot(spec.name)[first + lo : first + hi] = spec.initial_value

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
