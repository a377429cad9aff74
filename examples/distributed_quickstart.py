"""embengine on several processes: the quickstart's tables sharded over the ranks.

Run with torchrun (gloo on CPU; here two processes on this machine)::

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29531 \\
        examples/distributed_quickstart.py

Every rank draws the same global batch and trains on its own slice of it (in a real job each
rank reads its own shard of the data). The ``ShardedEngine`` keeps each table's rows on their
owners (row r on rank r mod W) and trains exactly as one ``EmbeddingEngine`` would on the whole
batch: at the end, rank 0 trains that single engine on the same batches and compares every
table, bit for bit.
"""

import os

# Idle OpenMP threads sleep instead of spinning beside embengine's update threads; it must be
# set before libgomp loads (kernels/tasks.py; the embengine CLI does the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

import embengine as ee  # noqa: E402
from embengine.distributed import ShardedEngine  # noqa: E402

N_USERS, N_ITEMS, DIM, BATCH, STEPS = 2000, 500, 8, 512, 100


def features():
    user = ee.TableConfig(
        N_USERS,
        DIM,
        name="user",
        combiner="sum",
        optimizer=ee.optimizers.Adagrad(learning_rate=0.1),
    )
    item = ee.TableConfig(N_ITEMS, DIM, name="item", combiner="sum")
    return {"user_id": ee.FeatureConfig(user), "item_id": ee.FeatureConfig(item)}


OPTIMIZER = ee.optimizers.FTRL(learning_rate=0.1, l2_regularization_strength=1e-3)


def batches():
    """The global batches, the same on every rank."""
    rng = np.random.default_rng(0)
    true_u = rng.normal(0, 1.0, (N_USERS, DIM))
    true_v = rng.normal(0, 1.0, (N_ITEMS, DIM))
    for _ in range(STEPS):
        users = rng.integers(0, N_USERS, BATCH)
        items = rng.zipf(1.3, BATCH) % N_ITEMS  # popular items repeat within a batch
        clicks = rng.random(BATCH) < 1 / (1 + np.exp(-np.sum(true_u[users] * true_v[items], 1)))
        yield users, items, clicks


def train_step(engine, users, items, clicks) -> float:
    acts = engine.lookup({"user_id": users, "item_id": items})
    u, v = acts["user_id"], acts["item_id"]
    p = 1 / (1 + np.exp(-np.sum(u * v, axis=1)))
    loss = -np.sum(clicks * np.log(p + 1e-7) + (1 - clicks) * np.log(1 - p + 1e-7))
    d_logit = (p - clicks)[:, None]  # gradient of the summed logloss
    engine.apply_gradients({"user_id": d_logit * v, "item_id": d_logit * u})
    return float(loss)


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets the rank, world size and address
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = ShardedEngine(features(), optimizer=OPTIMIZER, sharding="row")
    lo, hi = BATCH * rank // world, BATCH * (rank + 1) // world  # this rank's slice
    losses = []
    for step, (users, items, clicks) in enumerate(batches()):
        losses.append(train_step(engine, users[lo:hi], items[lo:hi], clicks[lo:hi]))
        if rank == 0 and (step % 25 == 0 or step == STEPS - 1):
            sent = sum(sum(c.values()) for c in engine.bytes_sent.values())
            print(
                f"step {step:3d}  rank 0 logloss {np.mean(losses[-25:]) / (hi - lo):.4f}  "
                f"bytes sent by rank 0 this step {sent:,}"
            )
    contents = engine.table_contents()  # collective: every rank gathers the tables
    if rank == 0:
        single = ee.EmbeddingEngine(features(), optimizer=OPTIMIZER)
        for users, items, clicks in batches():
            train_step(single, users, items, clicks)
        for table, arrays in single.state_dict()["tables"].items():
            for key, want in arrays.items():
                assert np.array_equal(contents["tables"][table][key], want), (table, key)
        print(
            f"{world} ranks: every table and slot equals the single engine's after {STEPS} "
            f"steps ({engine.plan})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
