"""The storage plan: which logical tables share which physical table, where, in RAM or a file.

``plan_storage`` is a pure function of the resolved features, each table's optimizer and the
engine's ``storage=`` / ``storage_dir=`` arguments (it touches no file). Its result, a frozen
``StoragePlan``, is what the engine builds its DenseTables from and what tests and tools read
(``engine.storage_plan``), in the spirit of jax-tpu-embedding's ``StackedTableSpec`` /
``TableSettingInStack``.

Low-dimensional packing is decided here, in one predicate (``packs_with``): two logical tables
share a physical table, one after the other, when both

- have dim 1, 2 or 4, the same dim, and an optimizer with ``low_dimensional_packing_status``;
- have equal optimizers (so one update kernel call with one learning rate serves both);
- have equal ``quantization_config`` (one lookup kernel call serves both);
- have equal ``weights_dtype`` and ``slots_dtype`` (one row layout);
- are stored in RAM. A memory-mapped table is never packed: its file ``{storage_dir}/{table}.f32``
  holds that table alone, so a file is named after the one table it holds and a RAM table never
  ends up in a file.

A keyed table (``TableConfig(vocabulary_size=None, dynamic=...)``) is stored as kind "keyed"
(``storage/keyed.py``; ``storage="ram"``, the default, means that for it), alone in its
physical table, with no vocabulary size (None) and its ``DynamicVocabulary`` in the plan.

Each table joins the first earlier physical table it packs with (whose first table it packs
with), else starts a new one: physical tables are in order of their first table, tables in a
physical table in table order, each at the row after the one before it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .registry import KEYED_KINDS, storage_kind, storage_kinds

if TYPE_CHECKING:
    from ..config import ResolvedFeatures
    from ..optimizers import Optimizer

__all__ = [
    "PACKABLE_DIMS",
    "STORAGE_KINDS",
    "PhysicalTableSpec",
    "StoragePlan",
    "TableInStack",
    "packs_with",
    "plan_storage",
]

# The built-in kinds; ``registry.register_storage_kind`` adds more (``registry.storage_kinds()``).
STORAGE_KINDS = ("ram", "mmap")
PACKABLE_DIMS = (1, 2, 4)
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TableInStack:
    """One logical table's place in its physical table.

    Attributes:
      name: the logical table's name.
      row_offset: the table's first row in the physical table: the row of its id 0 in a
        storage whose rows are ids (``TableStorage.row_bases``, DenseTable); other storages
        map ids to rows themselves (``rows_for``).
      vocabulary_size: the table's rows, ``row_offset .. row_offset + vocabulary_size``; None
        for a keyed table (its rows come and go with its keys).
      features: the features that look the table up, in the engine's feature order.
      dynamic: a keyed table's ``config.DynamicVocabulary``; None for every other table.
    """

    name: str
    row_offset: int
    vocabulary_size: int | None
    features: tuple[str, ...]
    dynamic: Any = None


@dataclass(frozen=True)
class PhysicalTableSpec:
    """One physical table (a ``TableStorage``: DenseTable for "ram" and "mmap"): logical tables
    stacked one after another.

    Attributes:
      name: the member tables' names joined by "+" (the storage's name).
      dim: the width of every member's rows.
      storage: "ram", "mmap" for a table in the file ``path``, or a kind registered with
        ``storage.registry.register_storage_kind``.
      path: the file of an "mmap" table (``{storage_dir}/{table}.f32``); None in RAM.
      tables: the member tables, in row order; a table that is not packed is the only one.
      weights_dtype, slots_dtype: the stored dtypes of the weights and the float slots
        (``TableConfig``; tables of other dtypes are not packed together).
    """

    name: str
    dim: int
    storage: str
    path: str | None
    tables: tuple[TableInStack, ...]
    weights_dtype: str = "float32"
    slots_dtype: str = "float32"

    @property
    def vocabulary_size(self) -> int:
        """Rows of the physical table: the members' rows, one table after the other (None for
        a keyed table)."""
        if any(t.vocabulary_size is None for t in self.tables):
            return None
        return sum(t.vocabulary_size for t in self.tables)

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)


@dataclass(frozen=True)
class StoragePlan:
    """Every physical table of an engine, in the order the engine holds them (its batches'
    tables and activation matrices follow this order). Checked on construction: member tables
    lie one after another from row 0, no table or feature appears twice, an "mmap" table has a
    path and no partner, a "ram" table no path."""

    physical_tables: tuple[PhysicalTableSpec, ...]

    def __post_init__(self):
        _check_plan(self)

    @property
    def table_names(self) -> tuple[str, ...]:
        """Every logical table, physical table by physical table."""
        return tuple(t.name for p in self.physical_tables for t in p.tables)

    def locate(self, table_name: str) -> tuple[int, TableInStack]:
        """(index of the physical table holding ``table_name``, its place in it)."""
        for p, spec in enumerate(self.physical_tables):
            for t in spec.tables:
                if t.name == table_name:
                    return p, t
        raise KeyError(
            f"the storage plan has no table {table_name!r}; it has {list(self.table_names)}"
        )

    def storage_layout(self) -> list[list[tuple[str, int]]]:
        """Per physical table, its features with the row offset of their table in it (what
        ``batch.plan_tables`` takes), each table's features together; the offset is -1 in a
        storage kind whose rows are not its ids (``StorageKind.row_ids``): the engine resolves
        those rows with the storage's ``rows_for``."""
        layout = []
        for p in self.physical_tables:
            ids_are_rows = storage_kind(p.storage).row_ids
            layout.append(
                [(f, t.row_offset if ids_are_rows else -1) for t in p.tables for f in t.features]
            )
        return layout

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (e.g. for a checkpoint manifest); ``from_json`` reads it back."""
        return {
            "format_version": _FORMAT_VERSION,
            "physical_tables": [
                {
                    "name": p.name,
                    "dim": p.dim,
                    "storage": p.storage,
                    "path": p.path,
                    "tables": [_table_json(t) for t in p.tables],
                    # only a 16-bit table has them: older plans read unchanged
                    **{
                        k: getattr(p, k)
                        for k in ("weights_dtype", "slots_dtype")
                        if getattr(p, k) != "float32"
                    },
                }
                for p in self.physical_tables
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StoragePlan:
        """The plan ``to_json`` wrote; a missing or unknown key, or a value of the wrong type or
        out of place, is a ValueError naming where it is."""
        where = "storage plan"
        _take(data, where, {"format_version": _ANY, "physical_tables": _LIST})
        if data["format_version"] != _FORMAT_VERSION:
            raise ValueError(
                f"{where}: format_version {data['format_version']!r:.80} is not supported (this "
                f"embengine reads {_FORMAT_VERSION})"
            )
        physical = []
        for i, p in enumerate(data["physical_tables"]):
            at = f"{where}: physical_tables[{i}]"
            schema = {"name": _STR, "dim": _INT1, "storage": _KIND, "path": _PATH, "tables": _LIST}
            if isinstance(p, Mapping):
                schema.update({k: _DTYPE for k in ("weights_dtype", "slots_dtype") if k in p})
            _take(p, at, schema)
            tables = []
            for j, t in enumerate(p["tables"]):
                tat = f"{at}['tables'][{j}]"
                schema = {
                    "name": _STR,
                    "row_offset": _INT0,
                    "vocabulary_size": _INT1,
                    "features": _STRS,
                }
                dynamic = None
                if isinstance(t, Mapping) and "dynamic" in t:  # a keyed table
                    schema = {**schema, "vocabulary_size": _NONE, "dynamic": _DICT}
                _take(t, tat, schema)
                if "dynamic" in t:
                    from ..config import DynamicVocabulary

                    try:
                        dynamic = DynamicVocabulary(**t["dynamic"])
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"{tat}['dynamic']: {e}") from None
                tables.append(
                    TableInStack(
                        t["name"],
                        t["row_offset"],
                        t["vocabulary_size"],
                        tuple(t["features"]),
                        dynamic,
                    )
                )
            physical.append(
                PhysicalTableSpec(
                    p["name"],
                    p["dim"],
                    p["storage"],
                    p["path"],
                    tuple(tables),
                    p.get("weights_dtype", "float32"),
                    p.get("slots_dtype", "float32"),
                )
            )
        return cls(tuple(physical))


def _table_json(t: TableInStack) -> dict[str, Any]:
    out = {
        "name": t.name,
        "row_offset": t.row_offset,
        "vocabulary_size": t.vocabulary_size,
        "features": list(t.features),
    }
    if t.dynamic is not None:  # only keyed tables carry the key: older plans read unchanged
        out["dynamic"] = dataclasses.asdict(t.dynamic)
    return out


# -- validation ----------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# (test, what it wants) of each kind of JSON value from_json reads
_ANY = (lambda v: True, "anything")
_STR = (lambda v: isinstance(v, str), "a str")
_INT0 = (lambda v: _is_int(v) and v >= 0, "an int >= 0")
_INT1 = (lambda v: _is_int(v) and v >= 1, "an int >= 1")
_KIND = (
    lambda v: isinstance(v, str) and v in storage_kinds(),
    "one of the registered storage kinds (storage.registry)",
)
_PATH = (lambda v: v is None or isinstance(v, str), "a str or null")
_NONE = (lambda v: v is None, "null (a keyed table)")
_DICT = (lambda v: isinstance(v, Mapping), "an object")
_DTYPE = (lambda v: v in ("float32", "float16", "bfloat16"), "'float32', 'float16' or 'bfloat16'")
_LIST = (lambda v: isinstance(v, list | tuple), "a list")
_STRS = (
    lambda v: isinstance(v, list | tuple) and all(isinstance(f, str) for f in v),
    "a list of str",
)


def _take(obj, where: str, schema: dict[str, tuple]) -> None:
    """Check that ``obj`` is an object with exactly ``schema``'s keys, each of its kind."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} must be an object, got {obj!r:.80}")
    missing = [k for k in schema if k not in obj]
    extra = [k for k in obj if k not in schema]
    if missing or extra:
        problems = ([f"missing keys {missing}"] if missing else []) + (
            [f"unknown keys {extra}"] if extra else []
        )
        raise ValueError(f"{where}: {'; '.join(problems)} (expected {list(schema)})")
    for key, (ok, what) in schema.items():
        if not ok(obj[key]):
            raise ValueError(f"{where}[{key!r}] must be {what}, got {obj[key]!r:.80}")


def _check_plan(plan: StoragePlan) -> None:
    """The invariants of StoragePlan's docstring; errors name the physical and logical table."""
    if not isinstance(plan.physical_tables, tuple) or not all(
        isinstance(p, PhysicalTableSpec) for p in plan.physical_tables
    ):
        raise TypeError(
            f"StoragePlan.physical_tables must be a tuple of PhysicalTableSpec, got "
            f"{plan.physical_tables!r:.80}"
        )
    tables: dict[str, int] = {}
    features: dict[str, str] = {}
    for i, p in enumerate(plan.physical_tables):
        at = f"storage plan: physical_tables[{i}] ({p.name!r})"
        if not p.tables:
            raise ValueError(f"{at} holds no table")
        if p.name != "+".join(p.table_names):
            raise ValueError(
                f"{at}: the name must be its tables' names joined by '+' "
                f"({'+'.join(p.table_names)!r})"
            )
        if p.storage not in storage_kinds():
            raise ValueError(f"{at}: storage must be one of {storage_kinds()}, got {p.storage!r}")
        kind = storage_kind(p.storage)
        if kind.file != (p.path is not None):
            raise ValueError(
                f"{at}: an 'mmap' table needs a path and a 'ram' table has none; "
                f"got storage {p.storage!r} and path {p.path!r}"
            )
        if kind.file and len(p.tables) > 1:
            raise ValueError(
                f"{at}: a memory-mapped table holds one logical table (its file is "
                f"named after it), not {len(p.tables)}"
            )
        if not kind.packable and len(p.tables) > 1:
            raise ValueError(
                f"{at}: storage {p.storage!r} is not packable, but the table holds "
                f"{len(p.tables)} logical tables"
            )
        keyed = [t.name for t in p.tables if t.vocabulary_size is None or t.dynamic is not None]
        if keyed and (
            p.storage not in KEYED_KINDS
            or len(p.tables) > 1
            or any(t.vocabulary_size is not None or t.dynamic is None for t in p.tables)
        ):
            raise ValueError(
                f"{at}: a keyed table ({keyed[0]!r}) is stored alone, as storage 'keyed' or "
                "'keyed-mmap', with vocabulary_size None and its dynamic vocabulary"
            )
        if p.storage in KEYED_KINDS and not keyed:
            raise ValueError(f"{at}: storage {p.storage!r} holds a keyed table only")
        row = 0
        for j, t in enumerate(p.tables):
            if t.name in tables:
                raise ValueError(
                    f"{at}: table {t.name!r} is also in physical_tables[{tables[t.name]}]"
                )
            tables[t.name] = i
            if t.row_offset != row:
                raise ValueError(
                    f"{at}: tables[{j}] ({t.name!r}) starts at row {t.row_offset}; "
                    f"it must start at row {row}, right after the tables before "
                    "it"
                )
            row += t.vocabulary_size or 0
            for f in t.features:
                if f in features:
                    raise ValueError(
                        f"{at}: feature {f!r} of table {t.name!r} also looks up "
                        f"table {features[f]!r}"
                    )
                features[f] = t.name


# -- planning ------------------------------------------------------------------------------------


def _storage_kinds(names: Sequence[str], storage) -> dict[str, str]:
    """Table name -> storage kind from the engine's ``storage=``; errors name the bad value."""
    kinds = storage_kinds()
    if isinstance(storage, str):
        if storage not in kinds:
            raise ValueError(
                f"storage must be one of {kinds} or a dict of table name -> either, got {storage!r}"
            )
        return {n: storage for n in names}
    if not isinstance(storage, Mapping):
        raise TypeError(f"storage must be 'ram', 'mmap' or a dict, got {storage!r}")
    unknown = [n for n in storage if n not in names]
    if unknown:
        raise ValueError(f"storage names unknown tables {unknown}; tables are {list(names)}")
    kinds = {n: storage.get(n, "ram") for n in names}
    for n, kind in kinds.items():
        if not isinstance(kind, str) or kind not in storage_kinds():
            raise ValueError(
                f"storage of table {n!r} must be one of {storage_kinds()}, got {kind!r}"
            )
    return kinds


def _table_file(storage_dir: Path, name: str) -> str:
    """``{storage_dir}/{name}.f32``; a name that would put the file outside the folder (an
    absolute name, a ".." part) is a ValueError naming the table."""
    rel = Path(f"{name}.f32")
    if rel.is_absolute() or ".." in rel.parts or "\0" in name:
        raise ValueError(
            f"table {name!r} is memory-mapped, but its name would put its file "
            f"{name + '.f32'!r} outside storage_dir {str(storage_dir)!r}; rename the "
            "table or keep it in RAM"
        )
    return str(storage_dir / rel)


def table_files(
    resolved: ResolvedFeatures,
    storage: str | Mapping[str, str],
    storage_dir: str | os.PathLike | None,
    suffix: str = "",
) -> dict[str, tuple[str, str | None]]:
    """Table name -> (storage kind, its file or None) for an engine that keeps each table in
    a storage of its own (a ShardedEngine's shards: no packing), by ``plan_storage``'s rules
    and errors; ``suffix`` goes into each file's name (``{storage_dir}/{name}{suffix}.f32``:
    a rank's shard beside the other ranks' in one folder). Only the built-in kinds ("ram",
    "mmap" and their keyed twins) are accepted: a registered kind's table may not be one
    rank's share of the rows."""
    names = resolved.table_names
    kinds = _storage_kinds(names, storage)
    for n, cfg in zip(names, resolved.tables, strict=True):
        kinds[n] = _keyed_kind(n, cfg, kinds[n])
        if kinds[n] not in ("ram", "mmap", *KEYED_KINDS):
            raise ValueError(
                f"table {n!r}: storage {kinds[n]!r} is a registered storage kind; a "
                "ShardedEngine keeps its shards in 'ram' or 'mmap'"
            )
    if storage_dir is not None and not isinstance(storage_dir, str | os.PathLike):
        raise TypeError(f"storage_dir must be a path (str or os.PathLike), got {storage_dir!r}")
    if any(storage_kind(k).file for k in kinds.values()) and storage_dir is None:
        raise ValueError("storage='mmap' needs storage_dir= (a folder for the table files)")
    return {
        n: (k, _table_file(Path(storage_dir), f"{n}{suffix}") if storage_kind(k).file else None)
        for n, k in kinds.items()
    }


def _keyed_kind(name: str, cfg, kind: str) -> str:
    """The storage kind of a table given ``storage=`` said ``kind``: a keyed table is "keyed"
    ("ram", the default, means that for it) or "keyed-mmap" ("mmap": its rows in a file of
    storage_dir); only keyed tables are."""
    if cfg.vocabulary_size is None:
        if kind in ("ram", "keyed"):
            return "keyed"
        if kind in ("mmap", "keyed-mmap"):
            return "keyed-mmap"
        raise ValueError(
            f"table {name!r} is keyed (vocabulary_size=None), which is stored as 'keyed' in RAM "
            f"or 'keyed-mmap' in a file; storage {kind!r} does not hold keyed tables: leave it "
            "out of storage= or say 'ram' or 'mmap'"
        )
    if kind in KEYED_KINDS:
        raise ValueError(
            f"storage {kind!r} is for keyed tables; table {name!r} has vocabulary_size "
            f"{cfg.vocabulary_size}: make it TableConfig(vocabulary_size=None, ...) or store it "
            "in 'ram' or 'mmap'"
        )
    return kind


def packs_with(a: tuple, b: tuple) -> bool:
    """Whether two tables may share a physical table (see the module docstring). ``a`` and
    ``b`` are (TableConfig, Optimizer, storage kind)."""
    (cfg_a, opt_a, kind_a), (cfg_b, opt_b, kind_b) = a, b
    return (
        kind_a == kind_b
        and storage_kind(kind_a).packable
        and opt_a.low_dimensional_packing_status
        and opt_b.low_dimensional_packing_status
        and cfg_a.dim == cfg_b.dim
        and cfg_a.dim in PACKABLE_DIMS
        and opt_a == opt_b
        and cfg_a.quantization_config == cfg_b.quantization_config
        and cfg_a.weights_dtype == cfg_b.weights_dtype
        and cfg_a.slots_dtype == cfg_b.slots_dtype
    )


def plan_storage(
    resolved: ResolvedFeatures,
    optimizers: Sequence[Optimizer],
    storage: str | Mapping[str, str] = "ram",
    storage_dir: str | os.PathLike | None = None,
) -> StoragePlan:
    """The StoragePlan of an engine's tables (pure and deterministic: touches no file).

    Args:
      resolved: the engine's features and tables (``config.resolve_features``).
      optimizers: each table's optimizer, in table order.
      storage: "ram" or "mmap" for every table, or a dict of table name -> either (tables not
        named stay in RAM).
      storage_dir: folder of the "mmap" tables' files (required if a table uses "mmap").
    """
    names = resolved.table_names
    if len(optimizers) != len(names):
        raise ValueError(f"plan_storage: {len(optimizers)} optimizers for {len(names)} tables")
    kinds = _storage_kinds(names, storage)
    for n, cfg in zip(names, resolved.tables, strict=True):
        kinds[n] = _keyed_kind(n, cfg, kinds[n])
    uses_mmap = any(storage_kind(k).file for k in kinds.values())
    if storage_dir is not None and not isinstance(storage_dir, str | os.PathLike):
        raise TypeError(f"storage_dir must be a path (str or os.PathLike), got {storage_dir!r}")
    if uses_mmap and storage_dir is None:
        raise ValueError("storage='mmap' needs storage_dir= (a folder for the table files)")
    describe = [(cfg, optimizers[t], kinds[names[t]]) for t, cfg in enumerate(resolved.tables)]
    groups: list[list[int]] = []
    for t in range(len(names)):
        for g in groups:
            if packs_with(describe[g[0]], describe[t]):
                g.append(t)
                break
        else:
            groups.append([t])
    physical = []
    for g in groups:
        members, row = [], 0
        for t in g:
            cfg = resolved.tables[t]
            members.append(
                TableInStack(
                    names[t], row, cfg.vocabulary_size, resolved.table_features[t], cfg.dynamic
                )
            )
            row += cfg.vocabulary_size or 0
        kind = kinds[names[g[0]]]
        path = _table_file(Path(storage_dir), names[g[0]]) if storage_kind(kind).file else None
        first = resolved.tables[g[0]]
        physical.append(
            PhysicalTableSpec(
                "+".join(names[t] for t in g),
                first.dim,
                kind,
                path,
                tuple(members),
                first.weights_dtype,
                first.slots_dtype,
            )
        )
    return StoragePlan(tuple(physical))
