"""Train a table (plus its Adagrad slots) kept in a memory-mapped file, through the page cache.

    python examples/mmap_bigger_than_ram.py --rows 12_000_000 --dim 32 --dir /tmp/big

The table file is locked while it is mapped: a second run on the same ``--dir`` while this one
trains is refused, and its disk space is reserved up front (a full disk fails at creation).

To see it work in less memory than the table, run it in a memory-limited cgroup and measure
the peak resident memory, e.g. (cgroup v1, as root)::

    mkdir /sys/fs/cgroup/memory/emb && echo 1G > /sys/fs/cgroup/memory/emb/memory.limit_in_bytes
    echo $$ > /sys/fs/cgroup/memory/emb/cgroup.procs
    /usr/bin/time -v python examples/mmap_bigger_than_ram.py ...   # "Maximum resident set size"
"""

import argparse
import os
import time

# Idle OpenMP threads sleep instead of spinning beside embengine's update threads; it must be
# set before libgomp loads (kernels/tasks.py; the embengine CLI does the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

import embengine as ee  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=12_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dir", default="/tmp/embengine-mmap")
    args = p.parse_args()

    table = ee.TableConfig(
        args.rows,
        args.dim,
        name="big",
        combiner="sum",
        initializer=ee.initializers.RandomUniform(-0.01, 0.01),
    )
    t0 = time.perf_counter()
    engine = ee.EmbeddingEngine(
        {"ids": ee.FeatureConfig(table)},
        optimizer=ee.optimizers.Adagrad(0.05),
        storage="mmap",
        storage_dir=args.dir,
    )
    size = engine.storage_bytes
    print(
        f"table + slots: {size / 2**30:.2f} GiB in {args.dir}/big.f32, "
        f"initialised in {time.perf_counter() - t0:.1f} s"
    )
    rng = np.random.default_rng(0)
    bag = 20
    offsets = np.arange(0, args.batch_size * bag + 1, bag)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        # Zipf-like ids over the whole table (a discretised Pareto, scattered by a bijection)
        u = rng.random(args.batch_size * bag)
        ranks = np.minimum(np.floor(u ** (-1 / 0.1)), args.rows).astype(np.int64) - 1
        ids = (ranks * 2654435761) % args.rows
        acts = engine.lookup({"ids": ee.Ragged(ids, offsets=offsets)})
        engine.apply_gradients({"ids": np.full_like(acts["ids"], 0.01)})
    print(
        f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; "
        f"weights moved: {float(np.abs(engine.embedding_tables['big'][:1000]).max()):.4f}"
    )


if __name__ == "__main__":
    main()
