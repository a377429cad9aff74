"""Preprocess batches in torch DataLoader workers; look up and train in the main process.

    python examples/dataloader.py                        # Linux's default: forked workers
    python examples/dataloader.py --start-method spawn   # workers start a fresh interpreter

The workers' ``collate_fn`` turns samples into a PreparedBatch (validated, deduplicated) with
``engine.preprocessor()``: a small object holding the feature configs and storage layout, no
tables, so a spawned worker receives a few kB rather than the tables. In a forked worker it
builds the batch with the serial build of the preparation kernel (GNU OpenMP is not fork-safe:
a parallel kernel there would be killed); either way the batch equals ``engine.preprocess``'s
bit for bit. The main process hands it to the EmbeddingLayer, whose backward updates the
tables. The same model is trained with batches prepared in the main process, for comparison.
"""

import argparse
import functools
import multiprocessing
import os
import pickle
import time

# Idle OpenMP threads sleep instead of spinning, which on a busy machine stole the cores the
# workers and the other threads need (10x slower epochs on 2 loaded cores). It must be set
# before torch loads libgomp; the embengine CLI does the same (docs/design.md, Threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import embengine as ee  # noqa: E402
from embengine.torch import EmbeddingLayer  # noqa: E402

N_USERS, N_ITEMS, DIM, HISTORY = 1_000, 500, 16, 10


class Clicks(torch.utils.data.Dataset):
    """Synthetic samples: (user id, item id, the user's recent items, click), from a seed.
    A click is drawn with p = sigmoid(<u*, v*>) for hidden user and item vectors."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        true_u = rng.normal(0, 1.0, (N_USERS, 4))
        true_v = rng.normal(0, 1.0, (N_ITEMS, 4))
        self.users = rng.integers(0, N_USERS, n)
        self.items = rng.zipf(1.3, n) % N_ITEMS  # popular items repeat within a batch
        self.history = rng.zipf(1.3, (n, HISTORY)) % N_ITEMS
        self.lengths = rng.integers(0, HISTORY + 1, n)
        logits = np.sum(true_u[self.users] * true_v[self.items], axis=1)
        self.clicks = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int):
        history = self.history[i, : self.lengths[i]]
        return self.users[i], self.items[i], history, self.clicks[i]


def collate(samples, pre):
    """Runs in a worker: samples -> (PreparedBatch, clicks). Top level, so that it pickles
    (with functools.partial) for spawned workers."""
    users, items, histories, clicks = zip(*samples, strict=True)
    features = {
        "user": np.array(users),
        "item": np.array(items),
        "history": ee.Ragged(np.concatenate(histories), lengths=[len(h) for h in histories]),
    }
    return pre(features), torch.tensor(np.array(clicks))


class Model(torch.nn.Module):
    def __init__(self, engine: ee.EmbeddingEngine):
        super().__init__()
        self.embeddings = EmbeddingLayer(engine)
        self.top = torch.nn.Sequential(
            torch.nn.Linear(3 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, batch) -> torch.Tensor:
        emb = self.embeddings(batch)
        x = torch.cat([emb["user"], emb["item"], emb["history"]], dim=1)
        return (emb["user"] * emb["item"]).sum(1) + self.top(x).squeeze(1)


def build(seed: int = 0) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    user = ee.TableConfig(N_USERS, DIM, name="user", combiner="sum")
    item = ee.TableConfig(N_ITEMS, DIM, name="item", combiner="mean")
    engine = ee.EmbeddingEngine(
        {
            "user": ee.FeatureConfig(user),
            "item": ee.FeatureConfig(item),
            "history": ee.FeatureConfig(item),
        },
        optimizer=ee.optimizers.Adagrad(learning_rate=0.1),
        seed=seed,
    )
    model = Model(engine)
    return model, torch.optim.Adam(model.top.parameters(), lr=0.01)


def train_epoch(model, dense_opt, batches) -> float:
    losses = []
    for batch, clicks in batches:
        # Summed over the batch: each row's gradient is then its samples' own (Adam, for the
        # dense part, does not mind the scale).
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(batch), clicks, reduction="sum"
        )
        dense_opt.zero_grad()
        loss.backward()  # dense gradients, and the embedding update
        dense_opt.step()
        losses.append(loss.item() / len(clicks))
    return float(np.mean(losses))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--start-method",
        choices=multiprocessing.get_all_start_methods(),
        default=multiprocessing.get_start_method(),
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()

    data = Clicks(args.samples)
    model, dense_opt = build()
    pre = model.embeddings.preprocessor()
    print(
        f"{pre!r}: {len(pickle.dumps(pre))} bytes pickled, the engine's tables "
        f"{model.embeddings.engine.storage_bytes:,}"
    )
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=functools.partial(collate, pre=pre),
        multiprocessing_context=args.start_method,
        timeout=300,
        persistent_workers=args.workers > 0,  # a spawned worker takes seconds to start
    )

    # The same model, same seed, with batches prepared in the main process.
    main_model, main_opt = build()
    main_pre = main_model.embeddings.preprocessor()
    main_batches = [
        collate([data[i] for i in range(s, min(s + args.batch_size, len(data)))], main_pre)
        for s in range(0, len(data), args.batch_size)
    ]

    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        loss = train_epoch(model, dense_opt, loader)
        t1 = time.perf_counter()
        main_loss = train_epoch(main_model, main_opt, main_batches)
        t2 = time.perf_counter()
        print(
            f"epoch {epoch}: logloss {loss:.4f} with {args.workers} {args.start_method} "
            f"workers ({t1 - t0:.2f} s), {main_loss:.4f} with batches prepared before "
            f"({t2 - t1:.2f} s)"
        )

    same = all(
        np.array_equal(a, model.embeddings.engine.embedding_tables[name])
        for name, a in main_model.embeddings.engine.embedding_tables.items()
    )
    print(f"embedding tables equal bit for bit: {same}")
    assert same, "batches from the workers should train exactly as the main process's"


if __name__ == "__main__":
    main()
