"""numba's thread pool start-up must not change torch's thread count (they share libgomp)."""

import subprocess
import sys

SCRIPT = """
import sys
if sys.argv[1:] == ["unguarded"]:
    import embengine.kernels.pool as pool
    pool._started = True  # skip the guard: shows the test can fail
import torch
torch.set_num_threads(1)
assert torch.get_num_threads() == 1  # (this read is what exposes the reset)
import numpy as np
import embengine as ee
t = ee.TableConfig(10, 4)
eng = ee.EmbeddingEngine({"f": ee.FeatureConfig(t)}, optimizer=ee.optimizers.SGD(0.1))
acts = eng.lookup({"f": [[1, 2], [3]]})
eng.apply_gradients({"f": np.ones_like(acts["f"])})
print(torch.get_num_threads())
"""


def _threads_after(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1]


def test_first_numba_kernel_keeps_torch_thread_count():
    assert _threads_after() == "1"
    # Without the guard numba's pool start-up resets torch to NUMBA_NUM_THREADS (here > 1).
    assert _threads_after("unguarded") != "1"
