"""Cost accounting, fast: a fold's resource-seconds, their sums, the tables that show them, and the
default number of studies in flight.  The same on real runs: tests/test_studies_sweep.py."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from pipelines.execution.folds.config import FoldOutcome
from pipelines.execution.folds.trial import fold_cost
from pipelines.execution.studies.runs import study_cost
from pipelines.execution.sweep import max_concurrent_studies
from pipelines.results.study_results import StudySummary, ci_table

OUTCOME = {"fold": 0, "status": "ok", "time_start": 100.0, "time_end": 130.0, "world_size": 2}


def test_a_folds_cost_is_its_wall_time_times_what_its_workers_held():
    c = fold_cost(FoldOutcome.from_dict(OUTCOME), cpus_per_worker=1.5, gpus_per_worker=0.0)
    assert c["wall_seconds"] == 30.0 and c["cpu_seconds"] == 90.0 and c["gpu_seconds"] == 0.0
    assert c["restarts"] == c["resumes"] == c["redone_iterations"] == 0.0  # outcome.json without restart fields
    c = fold_cost(
        FoldOutcome.from_dict({**OUTCOME, "restarts": 2, "resumed_from": [40, 80], "redone_iterations": 17}), 1.0, 0.5
    )
    assert c["gpu_seconds"] == 30.0 and (c["restarts"], c["resumes"], c["redone_iterations"]) == (2.0, 2.0, 17.0)


def test_the_study_sums_its_trials_and_reports_the_diverged_share_apart():
    rows = [
        {"status": "ok", "cost_cpu_seconds": 10.0, "cost_gpu_seconds": 1.0},
        {"status": "diverged", "cost_cpu_seconds": 5.0, "cost_gpu_seconds": 0.5, "cost_restarts": 1.0},
        {"status": "ok", "cost_cpu_seconds": 7.0, "cost_gpu_seconds": 0.0, "__reproduction__": 0},
        {"error": "boom", "trial_id": "t3"},
    ]  # no result: nothing to add
    c = study_cost(rows)
    assert c["cost.cpu_seconds"] == 22.0 and c["cost.gpu_seconds"] == 1.5 and c["cost.restarts"] == 1.0
    assert c["cost.diverged.cpu_seconds"] == 5.0 and c["cost.diverged.gpu_seconds"] == 0.5


def test_the_sweeps_table_shows_cpu_and_gpu_hours():
    s = StudySummary("d/l", "d", "l", "run", "ok", cost={"cpu_seconds": 7200.0, "gpu_seconds": 0.0})
    table = ci_table([s]).splitlines()
    assert table[0].split()[-2:] == ["CPU-h", "GPU-h"] and table[2].split()[-2:] == ["2", "0"]
    assert ci_table([StudySummary("d/m", "d", "m", "run", "failed")]).splitlines()[2].split()[-2:] == ["–", "–"]


def _cfg(**resources):
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config

    doc = demo_config("cost", "runs")
    doc["resources"] = {**doc.get("resources", {}), **resources}
    return parse_config(doc, source="test")


def test_default_studies_in_flight_fill_a_local_ray_but_do_not_oversubscribe_it():
    cfg = _cfg(workers_per_fold=1, cpus_per_worker=1.0, max_concurrent_trials=2, max_concurrent_studies=None)
    demand = 2 * cfg.protocol.folds  # CPUs of one study at full trial concurrency
    assert max_concurrent_studies(cfg, None, {"CPU": demand * 3 + 1}, 10) == 3
    assert max_concurrent_studies(cfg, None, {"CPU": 2}, 10) == 1  # a small laptop: one at a time
    assert max_concurrent_studies(cfg, None, {"CPU": 1000}, 4) == 4  # never more than there are studies
    assert max_concurrent_studies(cfg, "ray://head:10001", {"CPU": 2}, 45) == 45  # a cluster: Ray's queue bounds
    gpu = _cfg(
        workers_per_fold=1, use_gpu=True, gpus_per_worker=1.0, max_concurrent_trials=1, max_concurrent_studies=None
    )
    assert max_concurrent_studies(gpu, None, {"CPU": 64, "GPU": 2 * gpu.protocol.folds}, 10) == 2
    assert max_concurrent_studies(_cfg(max_concurrent_studies=2), None, {"CPU": 1000}, 10) == 2


def test_a_local_rays_default_cpus_are_the_usable_cores_bounded_by_memory(monkeypatch):
    """The embedded Ray declares this machine's usable cores, not every fold of a trial: on 2 cores a trial's 4 folds
    run 2 at a time rather than 4 sharing them; memory bounds the fold workers; one fold's workers always fit."""
    from pipelines.execution.runtime import resources

    def machine(cores: int, gib: float) -> None:
        monkeypatch.setattr(resources, "usable_cpus", lambda: cores)
        monkeypatch.setattr(resources, "memory_gib", lambda: gib)

    one = _cfg(workers_per_fold=1, cpus_per_worker=1.0, max_concurrent_trials=1)
    machine(2, 24.0)
    assert resources.default_num_cpus(one) == 2  # not 4 folds + 1
    machine(16, 24.0)
    assert resources.default_num_cpus(one) == 16
    machine(16, 5.0)
    assert resources.default_num_cpus(one) == 4  # 0.8 × 5 GiB holds 4 fold workers of ~1 GiB
    machine(2, 24.0)
    assert resources.default_num_cpus(_cfg(workers_per_fold=2, cpus_per_worker=2.0)) == 4  # one DDP fold's 2 × 2
    assert max_concurrent_studies(one, None, {"CPU": resources.default_num_cpus(one)}, 3) == 1


def test_report_has_a_cost_column_in_every_format(tmp_path):
    from pipelines.results.report import write_report
    from tests.test_report import _populate

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "sweep-c")
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("sweep-c")
    for run in c.search_runs([exp.experiment_id], "tags.stage = 'study'"):
        if run.data.tags["loss"] == "mpa":
            for k, v in {
                "cost.cpu_seconds": 5400.0,
                "cost.gpu_seconds": 1800.0,
                "cost.diverged.cpu_seconds": 360.0,
                "cost.diverged.gpu_seconds": 0.0,
            }.items():
                c.log_metric(run.info.run_id, k, v)
    paths = write_report(uri, "sweep-c", tmp_path / "out", log_to_mlflow=False)
    md = paths["md"].read_text()
    assert "| loss | synthetic cost (CPU-h / GPU-h) |" in md
    assert "| mpa | 1.5 / 0.5 (0.1 / 0 diverged) |" in md and "| contrastive | – |" in md
    assert "1.5 / 0.5" in paths["html"].read_text()
    costs = {s["loss"]: s["cost"] for s in json.loads(paths["json"].read_text())["studies"]}
    assert costs["mpa"]["cpu_hours"] == pytest.approx(1.5) and costs["contrastive"] == {}


def test_trial_drivers_take_the_driver_resource_where_a_node_declares_it():
    """A trial driver takes no fold slot: the driver node's custom resource, or 0.01 CPU where none declares it."""
    from pipelines.execution.runtime.environment import TRIAL_DRIVER_RESOURCE, trial_bundle

    assert trial_bundle({"CPU": 8.0, TRIAL_DRIVER_RESOURCE: 10_000.0}) == {TRIAL_DRIVER_RESOURCE: 1}
    assert trial_bundle({"CPU": 8.0}) == {"CPU": 0.01}
