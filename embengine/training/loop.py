"""The main job: train a click model whose embedding tables live in the engine.

The dense part (DLRM or FM) is a torch module trained by torch Adam; the embeddings come from an
``EmbeddingLayer`` whose backward applies each table's fused optimizer (or, with
``embeddings="torch"``, from ``nn.EmbeddingBag(sparse=True)`` tables and a torch optimizer, for
comparison). Progress is a tqdm bar with examples/s and the running loss; after each epoch the
test AUC and logloss are printed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .. import config as ee_config
from ..engine import EmbeddingEngine
from ..torch import EmbeddingLayer
from .metrics import auc, logloss
from .models import MODELS, embedding_dim
from .options import DEFAULT_LR, ENGINE_OPTIMIZERS, RUN_LOCK, TrainConfig, check_resumable, in_use
from .ranks import Ranks
from .sources import DataSource, make_source

__all__ = ["TrainConfig", "TrainResult", "train", "ENGINE_OPTIMIZERS", "DEFAULT_LR"]


@dataclass
class TrainResult:
    """The reported epoch is the one with the best validation AUC (``best_epoch``, 1-based);
    ``test_auc`` and ``test_logloss`` are that epoch's. ``history`` has every epoch's figures."""

    test_auc: float
    test_logloss: float
    seconds: float
    steps: int
    history: list[dict]
    oracle_auc: float | None = None
    best_epoch: int = 0
    valid_auc: float = float("nan")
    stopped_early: bool = False
    compile_seconds: float = 0.0
    table_stats: dict | None = None  # the engine's, at the end (embeddings="engine")

    def stats_lines(self) -> list[str]:
        """One line per table of a keyed run: its rows and what was admitted (a sharded run:
        this rank's share, its keys)."""
        lines, stats, where = [], self.table_stats or {}, ""
        if "bytes_sent" in stats:  # a ShardedEngine's: per table this rank's keyed stats
            where = " on this rank"
            stats = {n: t["keyed"] for n, t in stats["tables"].items() if "keyed" in t}
        for name, s in stats.items():
            if s.get("kind") not in ("keyed", "keyed-mmap"):
                continue
            total = s.get("total", {})
            mib = sum(s["bytes"].values()) / 2**20
            lines.append(
                f"table {name}: {s['rows']} rows, {total.get('admitted', 0)} admitted, "
                f"{total.get('evicted', 0)} evicted, {mib:.1f} MiB{where}"
            )
        return lines

    def summary(self) -> str:
        """The run in one line, naming the reported epoch."""
        best = f" (best possible {self.oracle_auc:.4f})" if self.oracle_auc else ""
        last = self.history[-1] if self.history else None
        if last is not None and last["epoch"] + 1 != self.best_epoch:
            why = "stopped early" if self.stopped_early else "last"
            where = f"; {why} at epoch {last['epoch'] + 1}: test AUC {last['test_auc']:.4f}"
        else:
            where = ""
        return (
            f"test AUC {self.test_auc:.4f}{best}, test logloss {self.test_logloss:.4f} at "
            f"epoch {self.best_epoch} (best validation AUC {self.valid_auc:.4f}{where}), "
            f"{self.steps} steps in {self.seconds:.1f} s"
        )


def build_engine(
    source: DataSource, cfg: TrainConfig, max_rows: int | None = None, sharded: bool = False
):
    """The run's engine: one table per feature, the optimizer and learning rate of ``cfg``
    (``max_rows`` caps every table, for a miniature that compiles the same kernels); with
    ``sharded``, a ShardedEngine over the ranks (``cfg.sharding``), else an EmbeddingEngine."""
    width = embedding_dim(cfg.model, cfg.dim)
    optimizer = ENGINE_OPTIMIZERS[cfg.optimizer](cfg.learning_rate, width)
    features = {}
    for f in source.features:
        rows = None  # keyed (--vocabulary dynamic): rows made for the raw ids as they arrive
        if cfg.vocabulary != "dynamic":
            rows = f.vocabulary_size if max_rows is None else min(f.vocabulary_size, max_rows)
        table = ee_config.TableConfig(
            rows,
            width,
            combiner=f.combiner,
            name=f.name,
            weights_dtype=cfg.weights_dtype,
            slots_dtype=cfg.slots_dtype,
        )
        features[f.name] = ee_config.FeatureConfig(table)
    if sharded:
        from ..distributed import ShardedEngine

        return ShardedEngine(
            features,
            optimizer=optimizer,
            seed=cfg.seed,
            backend=cfg.backend,
            sharding=cfg.sharding,
        )
    return EmbeddingEngine(features, optimizer=optimizer, seed=cfg.seed, backend=cfg.backend)


def _optimizer_state(optim: torch.optim.Optimizer) -> tuple[dict[str, np.ndarray], dict]:
    """A torch optimizer's state as named arrays plus JSON (no pickle)."""
    state = optim.state_dict()
    tensors, scalars = {}, {}
    for pid, s in state["state"].items():
        for k, v in s.items():
            if torch.is_tensor(v):
                tensors[f"optim/{pid}/{k}"] = v.detach().cpu().numpy()
            else:
                scalars[f"{pid}/{k}"] = v
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _load_optimizer_state(optim, tensors: dict[str, np.ndarray], meta: dict) -> None:
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, pid, k = key.split("/", 2)
            state.setdefault(int(pid), {})[k] = torch.from_numpy(np.array(value))
    for key, value in meta["scalars"].items():
        pid, k = key.split("/", 1)
        state.setdefault(int(pid), {})[k] = value
    optim.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def evaluate(batches, embed, model, ranks: Ranks | None = None) -> tuple[float, float]:
    """(AUC, logloss) of the model on ``batches`` (with ``ranks``: each rank scores its slice
    of every batch, and the figures are those of all ranks' scores together)."""
    ranks = ranks or Ranks()
    labels, probs = [], []
    with torch.no_grad():
        for batch in batches:
            batch = ranks.slice(batch)
            emb = embed(batch.sparse)
            logits = model(emb, torch.from_numpy(batch.dense))
            probs.append(torch.sigmoid(logits).numpy())
            labels.append(batch.labels)
    y, p = ranks.gather(np.concatenate(labels)), ranks.gather(np.concatenate(probs))
    return auc(y, p), logloss(y, p)


def best_entry(history: list[dict]) -> tuple[dict | None, int]:
    """The epoch with the best validation AUC (the first of equals) and how many epochs have
    followed it: early stopping and the reported epoch both come from the history alone, so a
    resumed run decides as the straight one does."""
    best, since = None, 0
    for entry in history:
        if best is None or _valid_auc(entry) > _valid_auc(best):
            best, since = entry, 0
        else:
            since += 1
    return best, since


def _valid_auc(entry: dict) -> float:
    # Checkpoints written before the validation set recorded only the test AUC.
    return entry.get("valid_auc", entry["test_auc"])


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train ``cfg``'s model; after each epoch evaluate on the validation and the test set, and
    stop once the validation AUC has not improved for ``cfg.patience`` epochs (0: never).

    In a rank started by torchrun, the ranks train the single-process run together, each on its
    slice of every batch (embengine.training.ranks); rank 0 logs and returns the result, the
    others return it silently."""
    cfg.check()
    ranks = Ranks.join(cfg.bind_cores, log)
    if ranks.distributed or cfg.sharding != "row":
        cfg.check_distributed(ranks.world)
    with _run_lock(cfg, ranks):
        result = _train(cfg, log if ranks.rank == 0 else _silent, ranks)
    # Only after success: ending a group whose peer died can wait for it (torchrun ends a
    # failed rank's process anyway).
    ranks.leave()
    return result


def _silent(text: str) -> None:
    pass


try:  # POSIX; Windows has no flock, so no lock is taken there (as storage.dense)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


@contextlib.contextmanager
def _run_lock(cfg: TrainConfig, ranks: Ranks):
    """For the run: rank 0 holds ``cfg.checkpoint_dir``'s RUN_LOCK; if another process holds
    it, every rank raises ValueError naming it."""
    if not cfg.checkpoint_dir or fcntl is None:
        yield
        return
    folder, fd, holder = Path(cfg.checkpoint_dir), None, None
    if ranks.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            fd = None
        except OSError:  # no flock on this file system (a save will say so)
            pass
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    refused = ranks.total(0.0 if holder is None else 1.0)
    try:
        if refused:
            raise ValueError(in_use(folder, holder if holder is not None else "on rank 0"))
        yield
    finally:
        if fd is not None:  # unlocked before closing: a forked child shares the description
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _train(cfg: TrainConfig, log: Callable[[str], None], ranks: Ranks) -> TrainResult:
    torch.manual_seed(cfg.seed)
    source = make_source(cfg.dataset, raw_ids=cfg.vocabulary == "dynamic", **cfg.synthetic)
    width = embedding_dim(cfg.model, cfg.dim)
    names = [f.name for f in source.features]
    model = MODELS[cfg.model](names, width, source.n_dense)
    params = list(model.parameters())
    engine, sparse_optim, compile_seconds = None, None, 0.0
    if cfg.embeddings == "engine":
        from .warmup import compile_kernels

        compile_seconds = compile_kernels(
            source,
            lambda rows: build_engine(source, cfg, rows),
            cfg.batch_size,
            log,
            cfg.progress and ranks.rank == 0,
        )
        engine = build_engine(source, cfg, sharded=ranks.distributed)
        if ranks.distributed and cfg.sharding != "row":
            log("sharding: " + "; ".join(f"{t} {how}" for t, how in engine.plan.items()))
        embed = EmbeddingLayer(engine)
    else:
        from .baseline import TORCH_OPTIMIZERS, TorchEmbeddings

        plain = cfg.embeddings == "plain"
        embed = TorchEmbeddings(source.features, width, cfg.seed, sparse=not plain)
        if plain:  # one dense Adam for the tables and the dense layers
            params += list(embed.parameters())
        else:
            sparse_optim = TORCH_OPTIMIZERS[cfg.optimizer](
                list(embed.parameters()), cfg.learning_rate
            )
    dense_optim = torch.optim.Adam(params, lr=cfg.dense_lr)
    dense = ranks.wrap_model(model)  # the model, whose gradients are summed over ranks

    step, start_epoch, start_batch, history = 0, 0, 0, []
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if cfg.resume and ckpt_dir is not None and _has_checkpoint(ckpt_dir):
        check_resumable(ckpt_dir, cfg)
        restored = engine.restore(ckpt_dir)
        state = restored.extra_metadata
        model.load_state_dict(
            {
                k[len("model/") :]: torch.from_numpy(np.array(v))
                for k, v in restored.extra_tensors.items()
                if k.startswith("model/")
            }
        )
        _load_optimizer_state(dense_optim, restored.extra_tensors, state["dense_optimizer"])
        for group in dense_optim.param_groups:  # this run's --dense-lr, as --lr for the tables
            group["lr"] = cfg.dense_lr
        step, start_epoch, start_batch = state["step"], state["epoch"], state["batch"]
        history = state["history"]
        log(f"resumed from {ckpt_dir} at step {step} (epoch {start_epoch}, batch {start_batch})")

    def save(epoch: int, batch: int) -> None:
        tensors = {f"model/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
        optim_tensors, optim_meta = _optimizer_state(dense_optim)
        tensors.update(optim_tensors)
        meta = {
            "step": step,
            "epoch": epoch,
            "batch": batch,
            "history": history,
            "dense_optimizer": optim_meta,
            "config": asdict(cfg),
        }
        engine.save(ckpt_dir, keep=cfg.keep, extra_tensors=tensors, extra_metadata=meta)

    loss_fn = torch.nn.BCEWithLogitsLoss()
    summed_loss = torch.nn.BCEWithLogitsLoss(reduction="sum")
    t_start = time.perf_counter()
    per_epoch = source.batches_per_epoch(cfg.batch_size)
    eval_size = cfg.batch_size * 8

    def stale() -> bool:
        """Early stopping: ``patience`` epochs without a better validation AUC (not with
        --steps, which asks for a number of steps)."""
        return cfg.steps is None and cfg.patience > 0 and best_entry(history)[1] >= cfg.patience

    def finished() -> bool:
        if cfg.steps is not None:
            return step >= cfg.steps
        return epoch >= cfg.epochs or stale()

    epoch = start_epoch
    trained = False
    while not finished():
        trained = True
        bar = _progress(cfg, source, epoch) if ranks.rank == 0 else None
        # The running (exponentially averaged) loss. On several ranks each averages its part of
        # every global batch's mean loss; the average is linear, so the parts' sum at the end of
        # the epoch is the single run's figure. The bar (rank 0) shows its own samples' loss.
        running = shown = None
        for i, batch in enumerate(
            source.train_batches(cfg.batch_size, epoch, start_batch), start=start_batch
        ):
            size = len(batch)
            batch = ranks.slice(batch)
            emb = embed(batch.sparse)
            logits = dense(emb, torch.from_numpy(batch.dense))
            if ranks.distributed:  # this rank's part of the global batch's mean loss
                loss = summed_loss(logits, torch.from_numpy(batch.labels)) / size
            else:
                loss = loss_fn(logits, torch.from_numpy(batch.labels))
            dense_optim.zero_grad()
            if sparse_optim is not None:
                sparse_optim.zero_grad()
            loss.backward()  # the engine's tables are updated here
            dense_optim.step()
            if sparse_optim is not None:
                sparse_optim.step()
            step += 1
            value = loss.item()
            running = value if running is None else 0.98 * running + 0.02 * value
            if bar is not None:
                own = value * size / len(batch) if ranks.distributed and len(batch) else value
                shown = own if shown is None else 0.98 * shown + 0.02 * own
                bar.update(size)
                bar.set_postfix(loss=f"{shown:.4f}", refresh=False)
            start_batch = i + 1
            if cfg.steps is not None and step >= cfg.steps:
                break
        if bar is not None:
            bar.close()
        running = ranks.total(running)
        if start_batch >= per_epoch:  # the epoch is complete (also when --steps ended it)
            epoch, start_batch = epoch + 1, 0
        valid_auc, valid_ll = evaluate(source.valid_batches(eval_size), embed, model, ranks)
        test_auc, test_ll = evaluate(source.test_batches(eval_size), embed, model, ranks)
        history.append(
            {
                "epoch": epoch if start_batch else epoch - 1,
                "step": step,
                "train_loss": running,
                "valid_auc": valid_auc,
                "valid_logloss": valid_ll,
                "test_auc": test_auc,
                "test_logloss": test_ll,
            }
        )
        oracle = source.oracle_auc
        best = f" (best possible {oracle:.4f})" if oracle else ""
        loss_text = "n/a" if running is None else f"{running:.4f}"
        log(
            f"epoch {history[-1]['epoch'] + 1}: step {step}, train loss {loss_text}, "
            f"valid AUC {valid_auc:.4f}, test AUC {test_auc:.4f}{best}, "
            f"test logloss {test_ll:.4f}"
        )
        if ckpt_dir is not None:
            save(epoch, start_batch)
    stopped_early = stale() and epoch < cfg.epochs
    if stopped_early and trained:
        best_epoch = best_entry(history)[0]["epoch"] + 1
        log(
            f"stopping early: no better validation AUC in the {cfg.patience} epochs after "
            f"epoch {best_epoch}"
        )
    if not history:  # nothing trained and nothing saved (--steps reached by a resumed run)
        valid_auc, valid_ll = evaluate(source.valid_batches(eval_size), embed, model, ranks)
        test_auc, test_ll = evaluate(source.test_batches(eval_size), embed, model, ranks)
        history.append(
            {
                "epoch": max(epoch - 1, 0),
                "step": step,
                "train_loss": None,
                "valid_auc": valid_auc,
                "valid_logloss": valid_ll,
                "test_auc": test_auc,
                "test_logloss": test_ll,
            }
        )
    seconds = time.perf_counter() - t_start
    if cfg.plot and ranks.rank == 0:
        _plot(history, cfg.plot)
        log(f"wrote {cfg.plot}")
    chosen = best_entry(history)[0]
    return TrainResult(
        chosen["test_auc"],
        chosen["test_logloss"],
        seconds,
        step,
        history,
        source.oracle_auc,
        best_epoch=chosen["epoch"] + 1,
        valid_auc=_valid_auc(chosen),
        stopped_early=stopped_early,
        compile_seconds=compile_seconds,
        table_stats=None if engine is None else engine.table_stats(),
    )


def _has_checkpoint(path: Path) -> bool:
    from ..checkpoint import latest_checkpoint

    return latest_checkpoint(path) is not None


def _progress(cfg: TrainConfig, source: DataSource, epoch: int):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    total = source.examples_per_epoch
    if cfg.steps is not None:
        total = min(total, cfg.steps * cfg.batch_size)
    return tqdm(
        total=total,
        unit="ex",
        unit_scale=True,
        desc=f"epoch {epoch + 1}",
        mininterval=0.5,
        dynamic_ncols=True,
    )


def _plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] + 1 for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, [h["train_loss"] for h in history], "o-", label="train loss (running)")
    left.plot(epochs, [h["test_logloss"] for h in history], "s-", label="test logloss")
    left.set_xlabel("epoch")
    left.legend()
    right.plot(epochs, [_valid_auc(h) for h in history], "o-", color="C1", label="validation")
    right.plot(epochs, [h["test_auc"] for h in history], "s-", color="C2", label="test")
    right.set_xlabel("epoch")
    right.set_ylabel("AUC")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
