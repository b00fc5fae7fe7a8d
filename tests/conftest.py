"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Train with one torch thread (deterministic and quick on the 2-core CI machine); restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head + two 2-CPU worker nodes, S3 and MLflow on PostgreSQL (``tests/cluster.py``), one per test module:
    the fault modules (``tests/test_faults*.py``) each get their own, so that two pytest workers run them side by
    side.  Skips without PostgreSQL."""
    from tests.cluster import ClusterUnavailable, local_cluster

    work = tmp_path_factory.mktemp("faults")
    try:
        cm = local_cluster(work, workers=2, worker_cpus=2)
        c = cm.__enter__()
    except ClusterUnavailable as e:
        pytest.skip(f"no PostgreSQL for the MLflow server: {e}")
    try:
        yield c
    finally:
        cm.__exit__(None, None, None)
