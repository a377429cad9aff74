"""What is timed: embengine and its peers, each behind the same small interface.

A runner builds its tables, converts a batch to its own input format (not timed) and runs one
training step (timed): lookup, the gradient of the summed activations, and the optimizer update.
Peers: torch ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim`` and FBGEMM's CPU table-batched
embedding (``fbgemm-gpu-cpu``), whose optimizer runs fused inside backward.
"""

from __future__ import annotations

import warnings

import numpy as np

from .workloads import Batch, Workload

# embengine configurations: name -> optimizer factory of (dim, packing); learning rate 0.01.
ENGINE_OPTIMIZERS = {
    "SGD": lambda dim, p: _opt().SGD(0.01, low_dimensional_packing_status=p),
    "Adagrad": lambda dim, p: _opt().Adagrad(0.01, low_dimensional_packing_status=p),
    "rowwise Adagrad": lambda dim, p: _opt().Adagrad(
        0.01, hessian_compression_times=dim, low_dimensional_packing_status=p
    ),
    "Adam": lambda dim, p: _opt().Adam(0.01, low_dimensional_packing_status=p),
    "FTRL": lambda dim, p: _opt().FTRL(0.01, low_dimensional_packing_status=p),
}


def _opt():
    from .. import optimizers

    return optimizers


def engine_name(optimizer: str, packing: bool = False, dtype: str = "float32") -> str:
    """An engine configuration's name in the bench tables, e.g. "embengine Adam (packed)
    [bfloat16]"."""
    return (
        f"embengine {optimizer}"
        + (" (packed)" if packing else "")
        + ("" if dtype == "float32" else f" [{dtype}]")
    )


class EngineRunner:
    """embengine with one optimizer for every table (``rowwise``: hessian_compression_times=dim),
    its weights and float slots stored as ``dtype`` ("float32", "float16" or "bfloat16")."""

    def __init__(
        self,
        w: Workload,
        optimizer: str,
        packing: bool = False,
        backend: str = "numba",
        dtype: str = "float32",
    ):
        import embengine as ee

        self.name = engine_name(optimizer, packing, dtype)
        self.lookup_only = w.lookup_only
        tables = []
        for t, (rows, dim) in enumerate(w.tables):
            opt = ENGINE_OPTIMIZERS[optimizer](dim, packing)
            tables.append(
                ee.TableConfig(
                    rows,
                    dim,
                    combiner="sum",
                    optimizer=opt,
                    name=f"t{t}",
                    initializer=ee.initializers.RandomUniform(-0.01, 0.01),
                    weights_dtype=dtype,
                    slots_dtype=dtype,
                )
            )
        self.engine = ee.EmbeddingEngine(
            {f"f{t}": ee.FeatureConfig(tab) for t, tab in enumerate(tables)}, backend=backend
        )
        self._ragged = ee.Ragged

    def prepare(self, batch: Batch):
        return {
            f"f{t}": self._ragged(ids, offsets=batch.offsets) for t, ids in enumerate(batch.ids)
        }

    def step(self, features) -> None:
        # A forward-only lookup updates nothing, so it skips the deduplication.
        acts = self.engine.lookup(features, training=not self.lookup_only)
        if self.lookup_only:
            return
        self.engine.apply_gradients({k: np.ones_like(a) for k, a in acts.items()})

    def close(self) -> None:
        del self.engine


class TorchRunner:
    """torch nn.EmbeddingBag(mode="sum", sparse=True) per table + a torch.optim optimizer."""

    def __init__(self, w: Workload, optimizer: str):
        import torch

        self.torch = torch
        self.name = f"torch {optimizer}" if not w.lookup_only else "torch F.embedding_bag"
        self.lookup_only = w.lookup_only
        # torch's sparse Adagrad warns on every run that it skips its invariant checks.
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly")
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for rows, dim in w.tables
        )
        params = list(self.bags.parameters())
        self.opt = None
        if not w.lookup_only:
            self.opt = {
                "SGD": lambda: torch.optim.SGD(params, lr=0.01),
                "Adagrad": lambda: torch.optim.Adagrad(params, lr=0.01),
                "SparseAdam": lambda: torch.optim.SparseAdam(params, lr=0.01),
            }[optimizer]()

    def prepare(self, batch: Batch):
        t = self.torch
        return [t.from_numpy(ids) for ids in batch.ids], t.from_numpy(batch.offsets[:-1])

    def step(self, prepared) -> None:
        ids, offsets = prepared
        t = self.torch
        if self.lookup_only:
            with t.no_grad():
                for bag, i in zip(self.bags, ids, strict=True):
                    t.nn.functional.embedding_bag(i, bag.weight, offsets, mode="sum")
            return
        self.opt.zero_grad(set_to_none=True)
        outs = [bag(i, offsets) for bag, i in zip(self.bags, ids, strict=True)]
        t.cat(outs, dim=1).sum().backward()
        self.opt.step()

    def close(self) -> None:
        del self.bags, self.opt


class FbgemmRunner:
    """FBGEMM SplitTableBatchedEmbeddingBagsCodegen on the CPU, optimizer fused into backward."""

    def __init__(self, w: Workload, optimizer: str):
        import torch
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            OptimType,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.torch = torch
        self.name = f"fbgemm {optimizer}"
        self.lookup_only = w.lookup_only
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in w.tables
            ],
            optimizer=getattr(OptimType, optimizer),
            learning_rate=0.01,
            eps=1e-8,
            pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32,
            device=torch.device("cpu"),
        )

    def prepare(self, batch: Batch):
        # Table-major: all bags of table 0, then table 1, ...; offsets over the concatenation.
        t = self.torch
        n = len(batch.ids[0])
        bags = len(batch.offsets) - 1
        offsets = np.concatenate(
            [batch.offsets[:-1] + i * n for i in range(len(batch.ids))] + [[n * len(batch.ids)]]
        )
        return t.from_numpy(np.concatenate(batch.ids)), t.from_numpy(offsets.astype(np.int64)), bags

    def step(self, prepared) -> None:
        ids, offsets, _ = prepared
        if self.lookup_only:
            with self.torch.no_grad():
                self.tbe(ids, offsets)
            return
        self.tbe(ids, offsets).sum().backward()

    def close(self) -> None:
        del self.tbe


def fbgemm_available() -> str | None:
    """None if FBGEMM's CPU build imports, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # ImportError, or an OSError from a mismatched torch
        return f"{type(e).__name__}: {e}"
    return None
