"""Multi-fidelity search (``protocol.pruning: asha``, docs/protocol.md §Pruning): the config fields (fast), the
trial's rung reports and the best-trial rule (fast), the study's pruned cost share (fast), and one real sweep
against ``mlflow server`` whose ASHA scheduler stops trials (slow): the pruned trials' runs carry ``status=pruned``
and their cost, the reproductions train to the full budget, the study finishes."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipelines.config.errors import ConfigError
from pipelines.execution.search.pruning import EVALUATION, PRUNED, Rungs
from pipelines.execution.search.searcher import best_result
from pipelines.names import OBJECTIVE
from tests.tiny_sweep import tiny_sweep

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ fast units


def _cfg(**protocol):
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config

    doc = demo_config("prune", "runs")
    doc["protocol"].update(protocol)
    return parse_config(doc, source="test")


def test_pruning_is_off_by_default_and_its_fields_are_checked_in_one_line():
    from pipelines.execution.search.pruning import pruning_on, search_space

    cfg = _cfg()
    assert cfg.protocol.pruning is None and not pruning_on(cfg) and search_space(cfg) == {}
    on = _cfg(pruning="asha", pruning_grace_period=1, pruning_reduction_factor=2)
    assert pruning_on(on) and on.protocol.pruning_reduction_factor == 2.0
    for bad, field in (
        ({"pruning": "hyperband"}, "protocol.pruning"),
        ({"pruning": "asha", "pruning_grace_period": 4}, "protocol.pruning_grace_period"),  # demo: 8 // 2 = 4
        ({"pruning_reduction_factor": 1}, "protocol.pruning_reduction_factor"),
        ({"pruning_grace_period": 0}, "protocol.pruning_grace_period"),
    ):
        with pytest.raises(ConfigError) as e:
            _cfg(**bad)
        assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value), str(e.value)


def test_ddp_folds_search_unpruned():
    """Ray Train folds cannot be cancelled by their trial: no scheduler, no rung reports."""
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config
    from pipelines.execution.search.pruning import pruning_on

    doc = demo_config("prune", "runs")
    doc["protocol"]["pruning"] = "asha"
    doc["resources"] = {**doc.get("resources", {}), "workers_per_fold": 2}
    assert not pruning_on(parse_config(doc, source="test"))


def test_a_trial_reports_the_fold_mean_of_best_so_far_once_every_fold_reached_an_evaluation():
    hist = {"a": [(0, 0.10), (4, 0.30), (8, 0.20)], "b": [(0, 0.12), (4, 0.14)]}  # step 0: the untrained evaluation
    reports: list[dict] = []
    rungs = Rungs({0: "a", 1: "b"}, max_t=4, history=lambda run: hist[run], report=reports.append)
    rungs.poll({0, 1})
    assert [r[EVALUATION] for r in reports] == [1]  # fold b has reached evaluation 1 only
    assert reports[0][OBJECTIVE] == pytest.approx((0.30 + 0.14) / 2)
    hist["b"].append((8, 0.40))
    rungs.poll({0, 1})
    assert reports[-1][EVALUATION] == 2 and reports[-1][OBJECTIVE] == pytest.approx((0.30 + 0.40) / 2)  # best so far
    rungs.poll({0})  # fold b finished (early stop): it has reached every evaluation, with its best value
    assert [r[EVALUATION] for r in reports] == [1, 2]  # fold a is still at evaluation 2
    hist["a"].append((12, 0.5))
    rungs.poll({0})
    assert [r[EVALUATION] for r in reports] == [1, 2, 3]  # never max_t: the trial's final result follows
    assert reports[-1][OBJECTIVE] == pytest.approx((0.5 + 0.40) / 2)


def test_the_best_trial_is_never_one_the_scheduler_stopped():
    """A pruned trial's last Tune result is one of its rung reports: its value is the objective of a shorter
    training and it must not win, however high."""
    reports: list[dict] = []
    Rungs({0: "a"}, 3, lambda run: [(0, 0.1), (4, 0.9)], reports.append, {"trial_id": "t_00001"}).poll({0})
    rows = [{"trial_id": "t_00000", OBJECTIVE: 0.5, "status": "ok"}, reports[-1]]
    assert reports[-1]["status"] == PRUNED and best_result(rows)["trial_id"] == "t_00000"


def test_the_study_reports_the_pruned_share_of_its_cost_apart():
    from pipelines.execution.studies.runs import study_cost

    rows = [
        {"status": "ok", "cost_cpu_seconds": 10.0},
        {"status": PRUNED, "cost_cpu_seconds": 3.0, "cost_gpu_seconds": 0.0},
        {"status": "diverged", "cost_cpu_seconds": 2.0},
    ]
    c = study_cost(rows)
    assert c["cost.cpu_seconds"] == 15.0 and c["cost.pruned.cpu_seconds"] == 3.0 and c["cost.diverged.cpu_seconds"] == 2
    assert "cost.pruned.cpu_seconds" not in study_cost([rows[0]])  # an unpruned study's metrics are unchanged


# ------------------------------------------------------------------------------------------------ the real sweep

TRIALS, MAX_EPOCHS, ITERS = 6, 6, 6


def _config(tmp: Path, uri: str) -> Path:
    from tests.paced_trunk import PACED_TRUNK

    return tiny_sweep(
        tmp,
        "prune",
        ["contrastive"],
        seed=5,
        datasets=[{"name": "synthetic", "kind": "synthetic", "num_classes": 16, "per_class": 6, "image_size": 16}],
        # steps that wait without CPU (tests/paced_trunk.py): folds long enough for the trial to see each evaluation
        model={"trunk": PACED_TRUNK, "embedding_dim": 8, "freeze_bn": False},
        protocol={
            "trials": TRIALS,
            "startup_trials": TRIALS,
            "sampler": "tpe",
            "iters_per_epoch": ITERS,
            "patience": MAX_EPOCHS,  # no early stop: a full budget is max_epochs × iters_per_epoch iterations
            "max_epochs": MAX_EPOCHS,
            "pruning": "asha",
            "pruning_grace_period": 1,
            "pruning_reduction_factor": 2,
            "train": {"classes_per_batch": 4, "m": 2, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
        },
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1, "num_cpus": 2},
        tracking={"uri": uri, "experiment": "prune-experiment"},
    )


@pytest.mark.slow
def test_a_pruned_sweep_records_pruned_trials_with_their_cost_and_reproduces_at_full_length(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.runs import PARENT, search_all
    from tests.mlflow_server import mlflow_server
    from tests.tiny_sweep import sweep_env

    with mlflow_server(tmp_path / "server") as uri, tempfile.TemporaryDirectory(prefix="ray") as ray_tmp:
        cfg = _config(tmp_path, uri)
        out = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=sweep_env(ray_tmp),
        )
        (tmp_path / "sweep.log").write_text(out.stdout + out.stderr)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        c = MlflowClient(uri)
        runs = search_all(c, c.get_experiment_by_name("prune-experiment").experiment_id, "")
    assert all(r.info.status == "FINISHED" for r in runs), [(r.data.tags, r.info.status) for r in runs]
    kids: dict[str, list] = {}
    for r in runs:
        kids.setdefault(r.data.tags.get(PARENT), []).append(r)
    (study,) = [r for r in runs if r.data.tags["stage"] == "study"]
    trials = [r for r in runs if r.data.tags["stage"] == "trial"]
    pruned = [t for t in trials if t.data.tags["status"] == PRUNED]
    full = ITERS * MAX_EPOCHS
    assert len(trials) == TRIALS and pruned, [t.data.tags["status"] for t in trials]
    assert len(pruned) < TRIALS and study.data.tags["done"] == "true"
    assert study.data.tags["best_trial_id"] not in {t.data.tags["trial_id"] for t in pruned}
    for t in pruned:
        folds = kids[t.info.run_id]
        assert len(folds) == 2 and all(f.data.tags["status"] == PRUNED for f in folds)
        assert t.data.metrics["cost.cpu_seconds"] > 0 and "stopped by the ASHA scheduler" in t.data.tags["reason"]
        assert t.data.metrics["cost.cpu_seconds"] == pytest.approx(
            sum(f.data.metrics["cost.cpu_seconds"] for f in folds)
        )
        assert t.data.metrics["pruned.evaluation"] < MAX_EPOCHS
        assert any(f.data.metrics.get("iterations", 0) < full for f in folds)  # stopped before the full budget
    m = study.data.metrics
    assert m["trials.pruned"] == len(pruned)
    assert m["cost.pruned.cpu_seconds"] == pytest.approx(sum(t.data.metrics["cost.cpu_seconds"] for t in pruned))
    assert m["cost.cpu_seconds"] > m["cost.pruned.cpu_seconds"] > 0
    reps = [r for r in runs if r.data.tags["stage"] == "reproduction"]
    assert len(reps) == 2
    for rep in reps:  # reproductions: never a scheduler, every fold trained to the full budget
        assert rep.data.tags["status"] == "ok"
        assert [f.data.metrics["iterations"] for f in kids[rep.info.run_id]] == [full, full]
    # the search's checkpoints of the cancelled folds are gone
    assert not list((tmp_path / "runs").rglob("ckpt/latest.json"))
    assert "pruning asha (grace 1, ×2)" in out.stdout and "[pruned" in out.stdout  # the search line, the trial lines
