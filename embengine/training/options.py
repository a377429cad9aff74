"""What ``embengine train`` accepts, checked without torch: the parser and the checks run (and fail
fast) before the training job imports torch, builds an engine or reads any data."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import optimizers as opt

__all__ = [
    "DEFAULT_LR",
    "ENGINE_OPTIMIZERS",
    "MODEL_NAMES",
    "PLOT_FORMATS",
    "TrainConfig",
    "check_resumable",
    "missing_packages",
]

# Table optimizers by name; each takes the learning rate and the table width.
ENGINE_OPTIMIZERS: dict[str, Callable[[float, int], opt.Optimizer]] = {
    "sgd": lambda lr, dim: opt.SGD(lr),
    "adagrad": lambda lr, dim: opt.Adagrad(lr),
    "rowwise_adagrad": lambda lr, dim: opt.Adagrad(lr, hessian_compression_times=dim),
    "adagrad_momentum": lambda lr, dim: opt.AdagradMomentum(lr, momentum=0.9),
    "proximal_adagrad": lambda lr, dim: opt.ProximalAdagrad(lr),
    "adam": lambda lr, dim: opt.Adam(lr),
    "amsgrad": lambda lr, dim: opt.AMSGrad(lr, bias_correction="per_row"),
    "lion": lambda lr, dim: opt.Lion(lr),
    "ftrl": lambda lr, dim: opt.FTRL(lr),
    "momentum": lambda lr, dim: opt.Momentum(lr),
    "rmsprop": lambda lr, dim: opt.RMSProp(lr),
    "adadelta": lambda lr, dim: opt.Adadelta(lr),
}
# Learning rates for the mean logloss of a batch, tuned on MovieLens-100K with the demo's
# settings (docs/performance.md has each one's test AUC).
DEFAULT_LR = {
    "sgd": 20.0,
    "adagrad": 0.5,
    "rowwise_adagrad": 0.5,
    "adagrad_momentum": 0.05,
    "proximal_adagrad": 0.5,
    "adam": 0.003,
    "amsgrad": 0.003,
    "lion": 1e-3,
    "ftrl": 1.0,
    "momentum": 2.0,
    "rmsprop": 0.003,
    "adadelta": 10.0,
}
MODEL_NAMES = ("dlrm", "fm")
# The formats --plot writes (matplotlib's Agg canvas), by file suffix.
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")
TORCH_OPTIMIZER_NAMES = ("sgd", "adagrad", "adam")
EMBEDDINGS = ("engine", "torch", "plain")
VOCABULARIES = ("fixed", "dynamic")
SHARDINGS = ("row", "table", "auto")  # ShardedEngine's sharding= (one for every table)


@dataclass
class TrainConfig:
    dataset: str = "movielens-100k"
    model: str = "dlrm"
    optimizer: str = "ftrl"
    lr: float | None = None  # None: DEFAULT_LR of the optimizer
    dense_lr: float = 1e-3
    dim: int = 16
    batch_size: int = 256
    epochs: int = 5
    patience: int = 2  # stop after this many epochs without a better validation AUC; 0: never
    steps: int | None = None  # stop after this many steps in total (overrides epochs)
    # "engine"; "torch": nn.EmbeddingBag(sparse=True) + the torch optimizer standing in for the
    # engine's; "plain": the plain torch DLRM (dense nn.EmbeddingBag, one Adam for everything).
    embeddings: str = "engine"
    backend: str = "numba"
    seed: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    keep: int = 2
    plot: str | None = None
    progress: bool = True
    synthetic: dict = field(default_factory=dict)  # SyntheticSource options
    # "fixed": tables of the data's vocabularies; "dynamic": keyed tables (any int64 id, rows made
    # as ids arrive) fed the raw ids.
    vocabulary: str = "fixed"
    # Ranks on this machine, each a torchrun process training its slice of every batch.
    nproc_per_node: int = 1
    # Every rank is started again this many times after one fails (with --resume: from the
    # newest checkpoint).
    max_restarts: int = 0
    # Each rank bound to its share of this machine's cores (embengine.distributed.bind_cores).
    bind_cores: bool = True
    # How a run of several ranks shards its tables (ShardedEngine's sharding=): "row" (row r
    # on rank r mod W), "table" (each table whole on one rank) or "auto" (the engine's pick).
    sharding: str = "row"
    # How the engine's tables store weights and optimizer slots (TableConfig): "float32",
    # "float16" or "bfloat16" (16-bit: stochastic rounding, embengine.precision).
    weights_dtype: str = "float32"
    slots_dtype: str = "float32"

    @property
    def learning_rate(self) -> float:
        """The tables' learning rate: ``lr``, or the optimizer's DEFAULT_LR."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def check(self) -> None:
        """Every option, before any work: ValueError naming the bad value and what to do."""
        from .sources import DATASETS

        if self.dataset not in DATASETS:
            raise ValueError(
                f"unknown dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}"
            )
        if self.model not in MODEL_NAMES:
            raise ValueError(
                f"unknown model {self.model!r}; choose one of {', '.join(MODEL_NAMES)}"
            )
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(
                f"embeddings must be one of {', '.join(EMBEDDINGS)}, got {self.embeddings!r}"
            )
        names = TORCH_OPTIMIZER_NAMES if self.embeddings == "torch" else ENGINE_OPTIMIZERS
        if self.optimizer not in names:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r} for embeddings={self.embeddings!r}; "
                f"choose one of {', '.join(names)}"
            )
        if self.backend not in ("numba", "reference"):
            raise ValueError(f"backend must be 'numba' or 'reference', got {self.backend!r}")
        for name in ("batch_size", "epochs", "dim", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.patience < 0:
            raise ValueError(f"--patience must be >= 0 (0: no early stopping), got {self.patience}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        for name in ("lr", "dense_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # also NaN
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.embeddings != "engine" and self.checkpoint_dir:
            raise ValueError("checkpoints are for the engine's tables (embeddings='engine')")
        if self.checkpoint_dir:
            self._check_checkpoint_dir(Path(self.checkpoint_dir))
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not (0 <= self.seed < 2**63)
        ):
            raise ValueError(f"--seed must be an int in [0, 2^63), got {self.seed!r}")
        if self.plot:
            self._check_plot(Path(self.plot))
        if self.dataset == "synthetic":
            self._check_synthetic()
        _int_at_least("--nproc-per-node", self.nproc_per_node, 1)
        if self.vocabulary not in VOCABULARIES:
            raise ValueError(
                f"--vocabulary must be one of {', '.join(VOCABULARIES)}, got {self.vocabulary!r}"
            )
        if self.vocabulary == "dynamic" and self.embeddings != "engine":
            raise ValueError(
                "--vocabulary dynamic makes the engine's keyed tables; leave --embeddings at engine"
            )
        self._check_dtypes()
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"--sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}"
            )
        if self.sharding != "row" and self.vocabulary == "dynamic":
            raise ValueError(
                f"--sharding {self.sharding}: --vocabulary dynamic makes keyed tables, which "
                "a sharded run spreads by key whatever the sharding; leave --sharding at row"
            )
        if self.nproc_per_node > 1:
            self.check_distributed(self.nproc_per_node)
        _int_at_least("--max-restarts", self.max_restarts, 0)
        if self.max_restarts and self.nproc_per_node == 1:
            raise ValueError("--max-restarts restarts the ranks: give --nproc-per-node too")
        if self.max_restarts and not self.resume:
            raise ValueError(
                "--max-restarts without --resume would restart from scratch; add "
                "--checkpoint-dir DIR --resume"
            )

    def _check_checkpoint_dir(self, path: Path) -> None:
        """A folder that can be made, and holds no other run's checkpoints unless resumed: a
        new run's saves would prune them (``--keep``)."""
        from ..checkpoint import latest_checkpoint

        for p in (path, *path.absolute().parents):
            if (p / "manifest.json").is_file():  # a checkpoint (or an export): not a run's folder
                what = "is" if p == path.absolute() else "is inside"
                raise ValueError(
                    f"--checkpoint-dir {path} {what} the checkpoint {p}, which a resume "
                    f"would not read and this run's saves would write into; give the folder "
                    f"holding it, {p.parent} (with --resume to continue from its newest "
                    "checkpoint), or a new folder"
                )
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    what = "is a file" if p == path else f"is under the file {p}"
                    raise ValueError(
                        f"--checkpoint-dir {path}: {what}, not a folder; name another folder"
                    )
                break
        _check_writable("--checkpoint-dir", path, path)
        if path.is_dir() and not self.resume:
            newest = latest_checkpoint(path)
            if newest is not None:
                raise ValueError(
                    f"--checkpoint-dir {path} holds checkpoints of an earlier run (newest: "
                    f"{Path(newest).name}), which this run's saves would prune; continue it "
                    "with --resume, or give a new folder"
                )

    def _check_dtypes(self) -> None:
        from ..precision import DTYPES

        sixteen = []
        for name in ("weights_dtype", "slots_dtype"):
            flag, value = f"--{name.replace('_', '-')}", getattr(self, name)
            if value not in DTYPES:
                raise ValueError(f"{flag} must be one of {', '.join(DTYPES)}, got {value!r}")
            if value != "float32":
                sixteen.append(f"{flag} {value}")
        if sixteen and self.embeddings != "engine":
            raise ValueError(
                f"{sixteen[0]} is for the engine's tables; leave --embeddings at engine"
            )

    def check_distributed(self, world: int) -> None:
        """What a run of ``world`` ranks cannot do yet: ValueError saying so."""
        if world == 1 and self.sharding != "row":
            raise ValueError(
                f"--sharding {self.sharding} shards the tables over ranks; this run has one "
                "process: give --nproc-per-node N (or launch it with torchrun), or leave "
                "--sharding out"
            )
        if self.embeddings != "engine":
            raise ValueError(
                f"{world} ranks train the engine's tables sharded; "
                f"--embeddings {self.embeddings} runs in one process"
            )
        if self.batch_size < world:
            raise ValueError(
                f"--batch-size {self.batch_size} is smaller than the {world} ranks it is split over"
            )

    def _check_plot(self, path: Path) -> None:
        suffix = path.suffix.lower().lstrip(".")
        if suffix not in PLOT_FORMATS:
            raise ValueError(
                f"--plot {path}: unknown image format {suffix or '(none)'!r}; end "
                f"the name with one of .{', .'.join(PLOT_FORMATS)}"
            )
        if path.is_dir():
            raise ValueError(f"--plot {path}: is a folder; give a file name")
        folder = path.parent
        if not folder.is_dir():
            raise ValueError(f"--plot {path}: folder {folder} does not exist; create it first")
        _check_writable("--plot", path, folder)

    def _check_synthetic(self) -> None:
        syn = self.synthetic
        for key, flag in (
            ("examples_per_epoch", "--epoch-examples"),
            ("test_examples", "--test-examples"),
        ):
            if key in syn and syn[key] < 1:
                raise ValueError(f"{flag} must be >= 1, got {syn[key]}")
        scale = syn.get("vocabulary_scale", 1.0)
        if not scale > 0:
            raise ValueError(f"--vocabulary-scale must be > 0, got {scale}")
        from ..data.synthetic import DEFAULT_VOCABULARIES

        largest = int(max(DEFAULT_VOCABULARIES) * scale)
        if largest > 10**8:
            raise ValueError(
                f"--vocabulary-scale {scale} makes a vocabulary of {largest} rows; "
                "vocabularies up to 10^8 rows are supported"
            )


# What a checkpoint of `embengine train` holds besides the tables, and the options a resumed
# run must share with it (the seed too: it orders each epoch's batches and, for keyed tables,
# gives new rows their values).
_RESUME_STATE = ("step", "epoch", "batch", "history", "dense_optimizer", "config")
_RESUME_SAME = (
    "dataset",
    "model",
    "dim",
    "optimizer",
    "embeddings",
    "batch_size",
    "seed",
    "vocabulary",
    "weights_dtype",
    "slots_dtype",
)
# The synthetic data's options a resume shares: they place the data position and make the
# validation set whose AUCs early stopping compares (the vocabularies: the tables' shapes).
_RESUME_SAME_SYNTHETIC = {
    "examples_per_epoch": "--epoch-examples",
    "test_examples": "--test-examples",
    "vocabulary_scale": "--vocabulary-scale",
}


def check_resumable(ckpt_dir: Path, cfg: TrainConfig) -> None:
    """Before anything is restored: the newest checkpoint in ``ckpt_dir`` was written by
    `embengine train` with the options this run must share; ValueError naming the flag."""
    from ..checkpoint import read_manifest
    from .sources import SyntheticSource

    ckpt, manifest = read_manifest(ckpt_dir, verify=False)  # the restore verifies its hashes
    state = manifest["extra"]["metadata"]
    missing = [k for k in _RESUME_STATE if k not in state]
    if missing:
        raise ValueError(
            f"--resume: the newest checkpoint in {ckpt_dir} was not written by "
            f"`embengine train` (no {', '.join(missing)}: a model and a data position to "
            "go on from); train into a new --checkpoint-dir, or load it with "
            "EmbeddingEngine.load"
        )
    saved = state["config"] if isinstance(state["config"], dict) else {}
    pairs = [
        (f"--{k.replace('_', '-')}", saved.get(k), getattr(cfg, k), k in saved)
        for k in _RESUME_SAME
    ]
    if cfg.dataset == "synthetic":
        syn = saved.get("synthetic") or {}
        default = SyntheticSource.__dataclass_fields__  # an option not given: its default
        pairs += [
            (flag, syn.get(k, default[k].default), cfg.synthetic.get(k, default[k].default), True)
            for k, flag in _RESUME_SAME_SYNTHETIC.items()
        ]
    for flag, was, now, known in pairs:
        if known and was != now:
            raise ValueError(
                f"--resume: {ckpt.name} in {ckpt_dir} was trained with {flag} {was}, this run "
                f"asks for {now}; resume with {flag} {was}, or train into a new --checkpoint-dir"
            )


# The file of a --checkpoint-dir that the run writing it holds locked (flock, released when
# its process ends): a second run there, resumed or not, would interleave its checkpoints with
# the first's and a later --resume would go on from either.
RUN_LOCK = ".embengine-train.lock"


def in_use(folder: Path, holder: str) -> str:
    return (
        f"--checkpoint-dir {folder} is in use by another embengine train (pid {holder}), whose "
        "checkpoints this run's would interleave with; wait for it to end (or stop it), or "
        "give another folder"
    )


def check_not_in_use(folder: Path) -> None:
    """ValueError if a run holds ``folder``'s RUN_LOCK now (the launcher's early look; each
    run's rank 0 holds it for the run)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (no flock: no run holds the lock)
        return
    try:
        fd = os.open(folder / RUN_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no run there yet
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            raise ValueError(in_use(folder, holder)) from None
        except OSError:  # no flock here
            return
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _check_writable(flag: str, path: Path, folder: Path) -> None:
    """That ``folder``, or the nearest of its parents that exists (where it will be made), takes
    new entries: a folder made and removed there, else ValueError before any work (an output
    that cannot be written failed after the training, its results lost)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".embengine-probe-", dir=existing))
    except OSError as e:
        raise ValueError(
            f"{flag} {path}: cannot write in {existing} ({e.strerror}); name a folder you can write"
        ) from None


def _int_at_least(flag: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be an int >= {minimum}, got {value!r}")


def missing_packages(cfg: TrainConfig) -> list[str]:
    """The packages this run needs that are not installed (torch; tqdm for the progress bar;
    matplotlib for --plot). Found without importing them."""
    needed = ["torch"]
    if cfg.progress:
        needed.append("tqdm")
    if cfg.plot:
        needed.append("matplotlib")
    return [name for name in needed if not _installed(name)]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a blocked import; a module set to None in sys.modules
        return False
