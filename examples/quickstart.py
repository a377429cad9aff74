"""embengine quickstart: two tables, a synthetic click task, a loss that falls.

A hidden model makes clicks: p(click) = sigmoid(<u*, v*>) for hidden user and item vectors. We
learn our own user and item tables (user: Adagrad, item: the global FTRL) with a dot-product model,
computing the activation gradients by hand in NumPy; the engine applies the fused updates.
"""

import os

# Idle OpenMP threads sleep instead of spinning beside embengine's update threads; it must be
# set before libgomp loads (kernels/tasks.py; the embengine CLI does the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

import embengine as ee  # noqa: E402
from embengine.compile_notice import compile_notice  # noqa: E402

rng = np.random.default_rng(0)
N_USERS, N_ITEMS, DIM, BATCH, STEPS = 2000, 500, 8, 512, 300
true_u = rng.normal(0, 1.0, (N_USERS, DIM))
true_v = rng.normal(0, 1.0, (N_ITEMS, DIM))

user = ee.TableConfig(
    N_USERS, DIM, name="user", combiner="sum", optimizer=ee.optimizers.Adagrad(learning_rate=0.1)
)
item = ee.TableConfig(N_ITEMS, DIM, name="item", combiner="sum")
engine = ee.EmbeddingEngine(
    {"user_id": ee.FeatureConfig(user), "item_id": ee.FeatureConfig(item)},
    optimizer=ee.optimizers.FTRL(learning_rate=0.1, l2_regularization_strength=1e-3),
)


def train_step(users, items, clicks) -> float:
    acts = engine.lookup({"user_id": users, "item_id": items})
    u, v = acts["user_id"], acts["item_id"]
    p = 1 / (1 + np.exp(-np.sum(u * v, axis=1)))
    loss = -np.mean(clicks * np.log(p + 1e-7) + (1 - clicks) * np.log(1 - p + 1e-7))
    d_logit = (p - clicks)[:, None]  # gradient of the summed (not mean) logloss
    engine.apply_gradients({"user_id": d_logit * v, "item_id": d_logit * u})
    return loss


losses = []
for step in range(STEPS):
    users = rng.integers(0, N_USERS, BATCH)
    items = rng.zipf(1.3, BATCH) % N_ITEMS  # popular items repeat within a batch
    clicks = rng.random(BATCH) < 1 / (1 + np.exp(-np.sum(true_u[users] * true_v[items], 1)))
    if step == 0:  # numba compiles the kernels here, once: say so instead of sitting silent
        with compile_notice():
            losses.append(train_step(users, items, clicks))
    else:
        losses.append(train_step(users, items, clicks))
    if step % 50 == 0 or step == STEPS - 1:
        print(f"step {step:4d}  logloss {np.mean(losses[-50:]):.4f}")

first, last = np.mean(losses[:50]), np.mean(losses[-50:])
print(f"mean logloss of the first 50 steps {first:.4f} -> last 50 steps {last:.4f}")
assert last < first, "the loss should fall"
