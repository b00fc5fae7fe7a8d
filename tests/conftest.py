"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest

#: The longest test modules, first.  ``make test`` hands whole modules to its two pytest-xdist workers in collection
#: order (``--dist loadfile --no-loadscope-reorder``; xdist would otherwise start with the modules that hold the most
#: tests, the quick parametrised ones, and end with these).  Most of them wait rather than compute (servers, clusters,
#: folds paced by tests/paced_trunk.py, outages): started first, their waiting overlaps the CPU-bound unit tests of
#: the other worker instead of being the suite's tail.  Modules that wait alternate with ones that compute.
LONGEST_FIRST = (
    "test_resume.py",
    "test_reeval.py",
    "test_faults.py",
    "test_faults_services.py",
    "test_packaging.py",
    "test_faults_driver_host.py",
    "test_sweep.py",
    "test_interrupt.py",
    "test_studies_sweep.py",
    "test_reuse.py",
    "test_postgres_tracking.py",
    "test_mlflow_ui.py",
)


def pytest_collection_modifyitems(items):
    """The modules of :data:`LONGEST_FIRST` first, in that order; the rest after them as collected.  Tests within a
    module keep their order (a module's fixtures and fault sequence depend on it)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_unchanged():
    """A test must leave ``MLFLOW_TRACKING_URI`` as it found it: ``mlflow.set_tracking_uri`` also sets it, and a
    later test of the same pytest worker (any module: ``make test`` hands modules out in its own order) would then
    read it as the user's tracking store.  Point MLflow's fluent API at a store with
    ``pipelines.tracking.model_registry.fluent_tracking`` or ``monkeypatch``."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    after = os.environ.get("MLFLOW_TRACKING_URI")
    assert after == before, f"the test left MLFLOW_TRACKING_URI={after!r} (it was {before!r})"


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
