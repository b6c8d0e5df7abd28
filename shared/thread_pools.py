"""The process's native thread pools (BLAS, OpenMP), found once.

threadpoolctl finds them by walking every loaded library, ≈ 4 ms a time; limiting them for each
message of a simulated site (``simulations.local_grid``) or each merge (``codebook.merge``) with
a fresh scan cost a fifth of a 1000-site local run (docs/benchmarks.md). The scan is kept.
"""

from __future__ import annotations

import functools

from threadpoolctl import ThreadpoolController


@functools.cache
def controller() -> ThreadpoolController:
    """The kept scan. scikit-learn is imported first: its OpenMP runtime (k-means) is one of the
    pools to limit, and a library loaded after the scan would not be."""
    import sklearn.cluster  # noqa: F401

    return ThreadpoolController()
