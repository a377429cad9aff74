"""Distributed training on torch.distributed: tables sharded over ranks with the semantics of
one big batch (``ShardedEngine``). Imports torch; ``import embengine`` does not import this."""

from .comm import PeerError
from .cores import bind_cores, core_share, job_cores
from .engine import DEFAULT_TIMEOUT, DistributedError, ShardedEngine
from .sharding import SHARDING_KINDS, ShardPlan, ShardTable, plan_shards

__all__ = [
    "DEFAULT_TIMEOUT",
    "SHARDING_KINDS",
    "DistributedError",
    "PeerError",
    "ShardPlan",
    "ShardTable",
    "ShardedEngine",
    "bind_cores",
    "core_share",
    "job_cores",
    "plan_shards",
]
