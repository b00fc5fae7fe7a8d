"""What every Ray worker process of a ``dmlrc`` job runs first (Ray's ``worker_process_setup_hook``, set by
:func:`pipelines.execution.ray_runtime.init_ray`).

:func:`scope_to_own_cluster` points the worker's ``RAY_ADDRESS`` at the cluster the worker belongs to.  Ray's State
API, which Ray Train's placement-group cleaner (a detached actor of every Train run) polls from a worker, otherwise
looks for "the" cluster on the machine: with a second Ray instance on the same machine (another user's sweep, a
``ray start`` cluster) it raises ``ConnectionError: Found multiple active Ray instances`` in the cleaner's thread,
which prints a 30-line traceback into the sweep's output, or it asks the other cluster about our actors.  With the
address set, the State API asks this cluster only; where it cannot answer (no dashboard), the cleaner's own handling
applies (a warning, below the log level the sweep gives Ray).

Standard library and Ray only: every worker process runs it, trial drivers that never load torch included.
"""

from __future__ import annotations

import os

__all__ = ["scope_to_own_cluster"]


def scope_to_own_cluster() -> None:
    """Set ``RAY_ADDRESS`` in this worker process to the GCS address of its own cluster."""
    import ray  # a worker process has Ray loaded and connected already

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
