"""embengine: train, bench, export, inspect.

Run ``embengine <command> --help`` for each command's options.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace


def _bench(args: argparse.Namespace) -> int:
    from .bench.distributed import DIST_WORKLOADS, format_distributed, run_distributed
    from .bench.floor import FLOOR_WORKLOADS, format_floor, run_floor
    from .bench.keyed import KEYED_WORKLOADS, format_keyed, run_keyed
    from .bench.runner import format_results, format_vocabulary, run_vocabulary, run_workload
    from .bench.threads import describe_threads

    print(describe_threads())
    for name in args.workloads:
        if name in KEYED_WORKLOADS:
            continue  # one table for all of them, below
        if name in DIST_WORKLOADS:
            dist_results = run_distributed(
                name,
                steps=args.steps,
                warmup=args.warmup,
                engine_optimizers=tuple(args.optimizers),
                dtypes=tuple(dict.fromkeys(args.dtypes)),
            )
            print()
            print(format_distributed(name, dist_results))
            print(flush=True)
            continue
        if name in FLOOR_WORKLOADS:
            floor_results = run_floor(
                steps=args.steps, warmup=args.warmup, engine_optimizers=tuple(args.optimizers)
            )
            print()
            print(format_floor(floor_results))
            print(flush=True)
            continue
        results = run_workload(
            name,
            steps=args.steps,
            warmup=args.warmup,
            engine_optimizers=tuple(args.optimizers),
            peers=tuple(p for p in ("torch", "fbgemm") if p not in args.skip),
            dtypes=tuple(dict.fromkeys(args.dtypes)),
        )
        print()
        print(format_results(name, results))
        print(flush=True)
    if "W3" in args.workloads:  # W3's target: its cost per id, timed beside W1 and W3-small
        results = run_vocabulary(
            steps=args.steps,
            warmup=args.warmup,
            engine_optimizers=tuple(args.optimizers),
            peers=tuple(p for p in ("fbgemm",) if p not in args.skip),
        )
        print(format_vocabulary(results))
    keyed = [name for name in args.workloads if name in KEYED_WORKLOADS]
    if keyed:
        keyed_results = run_keyed(keyed, scale=args.scale, steps=args.steps, warmup=args.warmup)
        print()
        print(format_keyed(keyed_results, args.scale))
    return 0


def _train(args: argparse.Namespace) -> int:
    from .training.options import TrainConfig, missing_packages

    cfg = TrainConfig(
        dataset=args.dataset,
        model=args.model,
        optimizer=args.optimizer,
        lr=args.lr,
        dense_lr=args.dense_lr,
        dim=args.dim,
        batch_size=args.batch_size,
        epochs=args.epochs,
        patience=args.patience,
        steps=args.steps,
        embeddings=args.embeddings,
        backend=args.backend,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        keep=args.keep,
        plot=args.plot,
        progress=not args.no_progress,
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        bind_cores=args.bind_cores,
        sharding=args.sharding,
        vocabulary=args.vocabulary,
        weights_dtype=args.weights_dtype,
        slots_dtype=args.slots_dtype,
        synthetic={  # the ones given; SyntheticSource has the parser's documented defaults
            key: value
            for key, value in (
                ("examples_per_epoch", args.epoch_examples),
                ("test_examples", args.test_examples),
                ("vocabulary_scale", args.vocabulary_scale),
            )
            if value is not None
        },
    )
    try:
        if cfg.dataset != "synthetic":
            for flag in ("--epoch-examples", "--test-examples", "--vocabulary-scale"):
                if getattr(args, flag[2:].replace("-", "_")) is not None:
                    raise ValueError(
                        f"{flag} is for --dataset synthetic; {cfg.dataset} has its own "
                        "examples and vocabularies (--steps shortens a run)"
                    )
        cfg.check()  # every option, before torch is imported or any data read
        if cfg.checkpoint_dir:  # and the folder's checkpoint, before any rank is launched
            from pathlib import Path

            from .checkpoint import latest_checkpoint
            from .training.options import check_not_in_use, check_resumable

            check_not_in_use(Path(cfg.checkpoint_dir))
            if cfg.resume and latest_checkpoint(cfg.checkpoint_dir) is not None:
                check_resumable(Path(cfg.checkpoint_dir), cfg)
        if args.baseline and cfg.embeddings != "engine":
            raise ValueError(
                "--baseline compares the engine's run with the plain torch DLRM; "
                "leave --embeddings at engine"
            )
        world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
        if cfg.sharding != "row" and cfg.nproc_per_node == 1 and world == 1:
            cfg.check_distributed(world)  # --sharding in one process: refused
        if args.baseline and (cfg.nproc_per_node > 1 or world > 1):
            raise ValueError(
                "--baseline runs in one process; leave out --nproc-per-node (and torchrun)"
            )
    except ValueError as e:
        print(f"embengine train: error: {e}", file=sys.stderr)
        return 2
    missing = missing_packages(cfg)
    if missing:
        print(
            f"embengine train: error: needs {' and '.join(missing)}, not installed here: "
            "pip install 'embengine[train]'",
            file=sys.stderr,
        )
        return 2
    from .training.ranks import in_launched_rank, launch

    if cfg.nproc_per_node > 1 and not in_launched_rank():
        return launch(args.argv, cfg.nproc_per_node, cfg.max_restarts)
    from .engine import NonFiniteGradientError
    from .training.loop import train

    try:
        result = train(cfg)
        if os.environ.get("RANK", "0") != "0":
            return 0  # rank 0 reports the run
        print(result.summary(), flush=True)
        for line in result.stats_lines():
            print(line)
        if args.baseline:
            print("the plain torch DLRM on the same data (--embeddings plain):", flush=True)
            twin = train(
                replace(cfg, embeddings="plain", checkpoint_dir=None, resume=False, plot=None)
            )
            print(twin.summary())
            print(format_comparison(cfg, result, twin))
    except (FloatingPointError, NonFiniteGradientError) as e:  # the run diverged
        # NonFiniteUpdateError (a FloatingPointError): the tables' updates overflowed;
        # NonFiniteGradientError: the model's gradients already held NaN or Inf.
        what = "tables' updates" if isinstance(e, FloatingPointError) else "model's gradients"
        print(
            f"embengine train: error: {e}\nthe {what} diverged: train with a smaller "
            f"--lr than {cfg.learning_rate:g}"
            + (" (or float32 tables)" if "float16" in (cfg.weights_dtype, cfg.slots_dtype) else "")
            + (", resumed from the last checkpoint with --resume" if cfg.checkpoint_dir else ""),
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as e:  # OSError: FileNotFoundError, a full disk, ...
        print(f"embengine train: error: {e}", file=sys.stderr)
        return 2
    return 0


def format_comparison(cfg, engine, twin) -> str:
    """The engine's run beside the plain torch DLRM's, each at its reported epoch."""
    rows = [(f"embengine ({cfg.optimizer} tables)", engine), ("plain torch DLRM (Adam)", twin)]
    lines = [f"{'':28} {'test AUC':>8} {'logloss':>8} {'epoch':>5} {'seconds':>7}"]
    for name, r in rows:
        lines.append(
            f"{name:28} {r.test_auc:8.4f} {r.test_logloss:8.4f} {r.best_epoch:5d} {r.seconds:7.1f}"
        )
    return "\n".join(lines)


def _export(args: argparse.Namespace) -> int:
    from .serving import export

    per_table = {}
    for item in args.table or []:
        # At the last '=': compressions have none, a table's name may ("user=id").
        name, _, comp = item.rpartition("=")
        if not name or not comp:
            print(
                f"embengine export: error: --table wants NAME=COMPRESSION, got {item!r}",
                file=sys.stderr,
            )
            return 2
        if name in per_table:
            print(
                f"embengine export: error: --table gives table {name!r} twice "
                f"({per_table[name]} and {comp}); give each table once",
                file=sys.stderr,
            )
            return 2
        per_table[name] = comp
    try:
        report = export(
            args.checkpoint,
            args.out,
            args.compress,
            per_table,
            args.fixed_range,
            replace=args.replace,
        )
    # CheckpointError is a ValueError; OSError: disk full...; ImportError: a bfloat16 table's
    # checkpoint without ml_dtypes (its message says what to install)
    except (ValueError, OSError, ImportError) as e:
        print(f"embengine export: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    print(f"wrote {report.path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .inspect import describe

    try:
        print(describe(args.path, verify=not args.no_verify))
    except (ValueError, OSError, ImportError) as e:  # OSError: a file it may not read, ...
        print(f"embengine inspect: error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .bench.distributed import DIST_WORKLOADS
    from .bench.floor import FLOOR_WORKLOADS
    from .bench.keyed import KEYED_WORKLOADS
    from .bench.peers import ENGINE_OPTIMIZERS
    from .bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(prog="embengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="time embengine against torch and FBGEMM on standard workloads",
        description="Time embengine, torch nn.EmbeddingBag(sparse=True) + torch.optim and "
        "FBGEMM's CPU TBE in this process, on fresh batches every step; print ms/step, M ids/s, "
        "first-step time, peak RSS and speed-ups.",
    )
    bench.add_argument(
        "--workloads",
        nargs="+",
        default=[*WORKLOADS, *FLOOR_WORKLOADS],
        choices=[*WORKLOADS, *DIST_WORKLOADS, *FLOOR_WORKLOADS, *KEYED_WORKLOADS],
        help="workloads to run (default: all but the W1-dist ones and the keyed ones, in one "
        "process; "
        "W1-dist: W1 on 1 process and on 2 ranks, in processes of its own (W1-keyed-dist: its "
        "tables keyed); W1-floor: each "
        "optimizer's update kernel against the floor of its memory work; W1-keyed, W1-new, "
        "W3-keyed, W4, insert: keyed tables against issue 15's targets, in one table)",
    )
    bench.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="shrink the keyed workloads' vocabularies and batches by this factor (quick runs)",
    )
    bench.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    bench.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    bench.add_argument(
        "--optimizers",
        nargs="+",
        default=list(ENGINE_OPTIMIZERS),
        choices=list(ENGINE_OPTIMIZERS),
        help="embengine optimizers to time",
    )
    bench.add_argument(
        "--skip", nargs="*", default=[], choices=["torch", "fbgemm"], help="peers not to run"
    )
    bench.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "float16", "bfloat16"],
        help="time the engine with its tables' weights and float slots stored in each of these "
        "dtypes (16-bit: stochastic rounding), each against the same peers (W1, W2 and the "
        "other one-process workloads; W1-dist: each dtype's five configurations, four for "
        "W1-keyed-dist)",
    )
    bench.set_defaults(func=_bench)

    from .training.options import DEFAULT_LR, EMBEDDINGS, ENGINE_OPTIMIZERS, MODEL_NAMES
    from .training.sources import DATASETS

    train = sub.add_parser(
        "train",
        help="train a click model (DLRM or FM) with the engine's tables",
        description="Train a DLRM or FM click model: embeddings in the engine (fused optimizer "
        "in backward), dense layers in torch (Adam). Prints test AUC and logloss per epoch.",
    )
    train.add_argument("--dataset", default="movielens-100k", choices=DATASETS)
    train.add_argument("--model", default="dlrm", choices=list(MODEL_NAMES))
    train.add_argument(
        "--optimizer",
        default="ftrl",
        choices=list(ENGINE_OPTIMIZERS),
        help="the tables' optimizer (with --embeddings torch: sgd, adagrad, adam)",
    )
    train.add_argument(
        "--lr",
        type=float,
        default=None,
        help="tables' learning rate (default, by optimizer: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
        + ")",
    )
    train.add_argument("--dense-lr", type=float, default=1e-3, help="torch Adam's learning rate")
    train.add_argument("--dim", type=int, default=16, help="embedding width")
    train.add_argument("--batch-size", type=int, default=256)
    what = train.add_mutually_exclusive_group()
    what.add_argument("--epochs", type=int, default=5, help="at most this many epochs")
    what.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    train.add_argument(
        "--patience",
        type=int,
        default=2,
        help="stop after this many epochs without a better validation AUC (0: "
        "never); the summary reports the best validation epoch",
    )
    train.add_argument(
        "--embeddings",
        default="engine",
        choices=list(EMBEDDINGS),
        help="engine (default); torch: nn.EmbeddingBag(sparse=True) + the torch "
        "optimizer of --optimizer; plain: the plain torch DLRM (dense "
        "nn.EmbeddingBag tables, one Adam at --dense-lr for all)",
    )
    train.add_argument(
        "--baseline",
        action="store_true",
        help="then train the plain torch DLRM on the same data and print both",
    )
    train.add_argument("--backend", default="numba", choices=["numba", "reference"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save a checkpoint (engine tables, dense model, optimizer, data "
        "position) after every epoch",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir",
    )
    train.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    train.add_argument(
        "--plot", default=None, metavar="FILE.png", help="write loss and AUC curves to this PNG"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train on N processes of this machine (torchrun, gloo), tables "
        "sharded, each rank on its slice of every batch: the same run as "
        "one process, up to float rounding",
    )
    train.add_argument(
        "--bind-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --nproc-per-node: bind each rank to its own share of the cores "
        "(default; a W1 step at 2 ranks on 2 cores 3-7%% faster); --no-bind-cores "
        "when other jobs share the machine's cores",
    )
    train.add_argument(
        "--sharding",
        default="row",
        choices=["row", "table", "auto"],
        help="with --nproc-per-node: how the tables are sharded over the ranks: row r on "
        "rank r mod N (default), each table whole on one rank, or auto (the engine picks "
        "per table by size and traffic, and the log says why); W1 at 2 ranks on 2 cores: "
        "2.2x the one process's step by row, 1.3x with its tables whole, which auto picks "
        "for it (docs/performance.md)",
    )
    train.add_argument(
        "--vocabulary",
        default="fixed",
        choices=["fixed", "dynamic"],
        help="dynamic: keyed tables (any int64 id; rows made as ids arrive) fed "
        "the raw ids, MovieLens' as in its files and its other tokens "
        "hashed to 64 bits; prints each table's stats at the end",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc-per-node: start every rank again, up to K times, "
        "after one fails; with --checkpoint-dir DIR --resume they go on from "
        "the newest checkpoint",
    )
    for what in ("weights", "slots"):
        train.add_argument(
            f"--{what}-dtype",
            default="float32",
            choices=["float32", "float16", "bfloat16"],
            help=f"how the tables store their {what}"
            + (" (float slots; integer ones stay int32)" if what == "slots" else "")
            + ": 16-bit halves the memory, math stays float32, updates are "
            "rounded stochastically",
        )
    syn = train.add_argument_group("synthetic data")
    syn.add_argument(
        "--epoch-examples", type=int, default=None, help="examples an epoch (default 1000000)"
    )
    syn.add_argument(
        "--test-examples",
        type=int,
        default=None,
        help="examples of the validation and of the test set (default 100000)",
    )
    syn.add_argument(
        "--vocabulary-scale",
        type=float,
        default=None,
        help="multiply every synthetic vocabulary (up to 10^8 rows; default 1)",
    )
    train.set_defaults(func=_train)

    exp = sub.add_parser(
        "export",
        help="write a checkpoint's weights for serving, compressed",
        description="Write the weights of a checkpoint (no optimizer slots) for "
        "embengine.serving.ServingEngine; prints sizes (fp32 MiB: the rows as float32; export "
        "MiB: as written; a keyed table's int64 keys count in both) and the max abs error per "
        "table.",
    )
    from .serving import COMPRESSIONS

    exp.add_argument("checkpoint", help="a checkpoint directory or a folder of them (newest)")
    exp.add_argument("out", help="the export folder to write: missing or empty (see --replace)")
    exp.add_argument("--compress", default="fp16", choices=COMPRESSIONS)
    exp.add_argument(
        "--table",
        action="append",
        metavar="NAME=COMPRESSION",
        help="per-table compression (repeatable)",
    )
    exp.add_argument(
        "--fixed-range",
        type=float,
        default=1.0,
        help="r of fixed_r8: codes k * r / 128 in [-r, 127 r / 128]",
    )
    exp.add_argument(
        "--replace",
        action="store_true",
        help="replace OUT if it is a previous export (OUT must otherwise be missing or empty; "
        "a folder holding checkpoints or other files is never replaced)",
    )
    exp.set_defaults(func=_export)

    insp = sub.add_parser(
        "inspect",
        help="describe a checkpoint or an export and verify its checksums",
    )
    insp.add_argument("path")
    insp.add_argument("--no-verify", action="store_true", help="skip the checksums")
    insp.set_defaults(func=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .bench.threads import configure_threads

    configure_threads()  # before anything imports torch
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # a launcher (train --nproc-per-node) starts its ranks with these
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
