"""Studies in parallel and their cost (item 2), on real tiny sweeps.

A sweep of three tiny studies (synthetic data, 1 trial, 2 reproductions, 2 kfold folds of 1 worker) with
``max_concurrent_studies`` left to its default on a local Ray of 6 CPUs (a study needs 2 → three at once): the study
runs' time spans overlap; a sweep of two with ``max_concurrent_studies: 1``: they follow one another.  Every study
finishes with its intervals either way.  The parallel sweep is also where cost accounting is checked on real runs: each
study run's ``cost.*`` is the sum of its fold runs', and ``dmlrc report`` shows the cost column.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.test_security import ray_tmpdir, sweep_env, tiny_sweep_config

LOSSES = ["contrastive", "triplet", "ntxent"]


def _config(tmp_path, uri: str, name: str, losses=tuple(LOSSES), **resources):
    path = tiny_sweep_config(tmp_path, uri, name=name, **resources)
    doc = yaml.safe_load(path.read_text())
    doc["losses"] = list(losses)
    path.write_text(yaml.safe_dump(doc))
    return path


def _sweep(tmp_path, cfg) -> subprocess.CompletedProcess:
    ray_tmp = ray_tmpdir()
    try:
        return subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
            env=sweep_env(ray_tmp),
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _runs(uri: str, experiment: str) -> dict[str, list]:
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    runs = search_all(c, c.get_experiment_by_name(experiment).experiment_id, "")
    by_stage: dict[str, list] = {}
    for r in runs:
        by_stage.setdefault(r.data.tags.get("stage"), []).append(r)
    return by_stage


def _spans(studies) -> list[tuple[int, int]]:
    return sorted((r.info.start_time, r.info.end_time) for r in studies)


def _check_studies_finished(by_stage, losses=tuple(LOSSES)) -> None:
    studies = by_stage["study"]
    assert sorted(r.data.tags["loss"] for r in studies) == sorted(losses)
    for r in studies:
        assert r.info.status == "FINISHED" and r.data.tags["status"] == "ok" and r.data.tags["done"] == "true"
        m = r.data.metrics
        for mode in ("concat", "separated"):
            assert {f"test.{mode}.map_at_r.{k}" for k in ("mean", "ci_low", "ci_high")} <= set(m), sorted(m)
            assert (
                m[f"test.{mode}.map_at_r.ci_low"]
                <= m[f"test.{mode}.map_at_r.mean"]
                <= m[f"test.{mode}.map_at_r.ci_high"]
            )


def _check_cost(by_stage) -> None:
    """study cost = Σ its trials' and reproductions' = Σ their fold runs' (cost.cpu_seconds = wall × 1 CPU × 1)."""
    from pipelines.tracking.runs import PARENT

    kids: dict[str, list] = {}
    for runs in by_stage.values():
        for r in runs:
            kids.setdefault(r.data.tags.get(PARENT), []).append(r)
    for study in by_stage["study"]:
        m = study.data.metrics
        parents = [r for r in kids[study.info.run_id] if r.data.tags["stage"] in ("trial", "reproduction")]
        folds = [f for p in parents for f in kids[p.info.run_id]]
        assert len(parents) == 3 and len(folds) == 6
        for f in folds:
            fm = f.data.metrics
            assert fm["cost.wall_seconds"] == pytest.approx(fm["time.end"] - fm["time.start"])
            assert fm["cost.cpu_seconds"] == pytest.approx(fm["cost.wall_seconds"])  # 1 worker × 1 CPU
            assert fm["cost.gpu_seconds"] == 0.0 and fm["cost.restarts"] == 0.0
            assert f.data.tags["node_id"]
        for p in parents:
            assert p.data.metrics["cost.cpu_seconds"] == pytest.approx(
                sum(f.data.metrics["cost.cpu_seconds"] for f in kids[p.info.run_id])
            )
        assert m["cost.cpu_seconds"] > 0
        assert m["cost.cpu_seconds"] == pytest.approx(sum(f.data.metrics["cost.cpu_seconds"] for f in folds))
        assert m["cost.wall_seconds"] == pytest.approx(sum(f.data.metrics["cost.wall_seconds"] for f in folds))
        assert m["cost.gpu_seconds"] == 0.0 and m["cost.diverged.cpu_seconds"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_studies_run_at_once_by_default_with_their_cost(tmp_path):
    from pipelines.results.report import write_report

    # default max_concurrent_studies on a local Ray of 6 CPUs: 6 // (1 trial × 2 folds × 1 worker × 1 CPU) = 3
    uri = f"sqlite:///{tmp_path / 'par.db'}"
    out = _sweep(tmp_path, _config(tmp_path, uri, "par", num_cpus=6))
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert "3 studies (synthetic/contrastive, synthetic/triplet, synthetic/ntxent), ≤ 3 at once" in out.stdout
    # progress stays per study; the final table is in the config's order and shows the cost
    for loss in LOSSES:
        assert f"[synthetic/{loss}] done in" in out.stdout
    table = out.stdout[out.stdout.index("finished in") :]
    assert [table.index(f"synthetic  {loss}") for loss in LOSSES] == sorted(
        table.index(f"synthetic  {loss}") for loss in LOSSES
    )
    assert "CPU-h" in table and "GPU-h" in table
    by_stage = _runs(uri, "par-experiment")
    _check_studies_finished(by_stage)
    spans = _spans(by_stage["study"])
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"the studies did not overlap: {spans}"
    _check_cost(by_stage)

    paths = write_report(uri, "par-experiment", tmp_path / "report", log_to_mlflow=False)
    md = paths["md"].read_text()
    assert "## Cost" in md and "synthetic cost (CPU-h / GPU-h)" in md
    assert "Cost</h2>" in paths["html"].read_text()
    report = json.loads(paths["json"].read_text())
    study = {s["run_id"]: s for s in report["studies"]}
    for r in by_stage["study"]:
        assert study[r.info.run_id]["cost"]["cpu_seconds"] == pytest.approx(r.data.metrics["cost.cpu_seconds"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_max_concurrent_studies_1_runs_them_one_after_another(tmp_path):
    uri = f"sqlite:///{tmp_path / 'seq.db'}"
    out = _sweep(tmp_path, _config(tmp_path, uri, "seq", LOSSES[:2], num_cpus=6, max_concurrent_studies=1))
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert "2 studies (synthetic/contrastive, synthetic/triplet), ≤ 1 at once" in out.stdout
    by_stage = _runs(uri, "seq-experiment")
    _check_studies_finished(by_stage, LOSSES[:2])
    spans = _spans(by_stage["study"])
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
