"""Settings for every test process (pytest-xdist workers and the subprocesses tests start)."""

import os

# Before anything imports torch: libgomp's threads (torch's and numba's "omp" layer) otherwise
# spin for milliseconds after each parallel region, and with pytest-xdist's workers filling the
# cores, the spinning steals the time the other worker needs (docs/performance.md, test time).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
