"""``dmlrc sweep CONFIG --plan`` / ``dmlrc demo --plan``: the sweep's checks, its counts and a calibrated cost
estimate, with nothing started (no Ray, no sweep folder, no MLflow DB)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import ray
import yaml

from pipelines.cli import main
from pipelines.config.presets import DEMO
from pipelines.config.schema import parse_config
from pipelines.execution import plan as plan_module
from pipelines.execution.plan import StudyCount, count_study


def _small(tmp_path, **protocol) -> dict:
    """The demo preset cut to one loss and a short protocol, stored under ``tmp_path``."""
    doc = copy.deepcopy(DEMO)
    doc["losses"] = [{"name": "contrastive"}]
    doc["storage"] = str(tmp_path / "runs")
    doc["protocol"].update(trials=2, startup_trials=1, reproductions=2, **protocol)
    return doc


@pytest.fixture
def no_ray(monkeypatch):
    """A sweep would start Ray: make that fail loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("--plan started Ray")

    monkeypatch.setattr(ray, "init", refuse)


def _nothing_created(tmp_path) -> None:
    assert not (tmp_path / "runs").exists()  # no sweep folder (and so no runs/<name>/mlflow.db)
    assert not list(tmp_path.rglob("mlflow.db"))
    assert not ray.is_initialized()


def test_sweep_plan_prints_counts_and_estimate_and_starts_nothing(tmp_path, no_ray, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(_small(tmp_path)))
    assert main(["sweep", str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan of sweep 'demo': 1 studies, 0 already covered" in out
    # 2 trials + 2 reproductions × 4 folds = 16 fold runs; 8 epochs × 8 iterations = 64 per fold; 1 + 8 / 2 evaluations
    row = next(line for line in out.splitlines() if line.strip().startswith("synthetic/contrastive"))
    assert row.split()[1:6] == ["2", "2", "16", "1,024", "80"]
    assert "≤ 1,024 training iterations" in out and "8 test embedding passes" in out
    assert "CPU-hours ≈" in out and "wall time ≈" in out and "ms/iteration" in out
    _nothing_created(tmp_path)


def test_demo_plan_counts_the_demo_and_starts_nothing(tmp_path, no_ray, capsys):
    assert main(["demo", "--plan", "--storage", str(tmp_path / "runs"), "--name", "d"]) == 0
    out = capsys.readouterr().out
    assert "plan of sweep 'd': 3 studies" in out
    # 3 studies × (2 trials + 3 reproductions) = 15 trials, 60 fold runs, 64 iterations each
    assert "total: 3 studies, 15 trials (6 search + 9 reproductions), 60 fold runs, ≤ 3,840 training iterations" in out
    _nothing_created(tmp_path)


def test_plan_of_a_bad_config_is_one_config_error(tmp_path, no_ray, capsys):
    doc = _small(tmp_path)
    doc["protocol"]["trials"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["sweep", str(path), "--plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: protocol.trials: ")
    _nothing_created(tmp_path)


ZOO = dict(trials=10, startup_trials=4, reproductions=3, iters_per_epoch=40, eval_every=1, patience=1, max_epochs=3)
DEMO_P = dict(trials=2, startup_trials=1, reproductions=3, iters_per_epoch=12, eval_every=2, patience=4, max_epochs=8)
ODD = dict(trials=7, startup_trials=1, reproductions=2, iters_per_epoch=5, eval_every=3, patience=20, max_epochs=9)


@pytest.mark.parametrize(
    "protocol, searched, expected",
    [
        # the omniglot zoo's protocol: 10 trials + 3 reproductions × 4 folds; 3 epochs × 40 iterations at the cap;
        # earliest stop: epoch 2 (patience 1, evaluation every epoch); evaluations at epochs 0..3
        (
            ZOO,
            True,
            dict(fold_runs=52, iterations=6240, iterations_min=4160, evaluations=208, evaluations_min=156, tests=12),
        ),
        # the demo's: earliest stop at epoch 6 (patience 4, evaluations every 2 epochs), cap 8
        (
            DEMO_P,
            True,
            dict(fold_runs=20, iterations=1920, iterations_min=1440, evaluations=100, evaluations_min=80, tests=12),
        ),
        # nothing searched: one trial of the fixed values; patience beyond the cap: the cap is the earliest stop
        (
            ODD,
            False,
            dict(fold_runs=12, iterations=540, iterations_min=540, evaluations=48, evaluations_min=48, tests=8),
        ),
    ],
)
def test_counts_match_hand_computed_numbers(tmp_path, protocol, searched, expected):
    doc = copy.deepcopy(DEMO)
    doc["protocol"].update(protocol)
    cfg = parse_config(doc)
    plan = SimpleNamespace(key="synthetic/contrastive", searched={"x": None} if searched else {})
    c = count_study(cfg, plan)
    assert c.fold_runs == expected["fold_runs"]
    assert c.iterations() == expected["iterations"]
    assert c.iterations(capped=False) == expected["iterations_min"]
    assert c.evaluations() == expected["evaluations"]
    assert c.evaluations(capped=False) == expected["evaluations_min"]
    assert c.test_passes == expected["tests"]


# ------------------------------------------------------------------------------------------------------ sharing


def _fold_of_work(seconds: float):
    """A study plan, count and timing whose fold compute is ``seconds`` CPU seconds of training (no set-up, no
    evaluation, no test pass): what the sharing arithmetic is given, without data or calibration."""
    table = SimpleNamespace(labels=[0], subset=lambda classes: [])
    manifest = SimpleNamespace(folds=[SimpleNamespace(val_classes=[0])], test_classes=[])
    plan = SimpleNamespace(
        key="synthetic/contrastive",
        loss=SimpleNamespace(name="contrastive"),
        dataset=SimpleNamespace(table=table, manifest=manifest),
    )
    timing = SimpleNamespace(
        iteration_s=seconds / 100, per_loss_s={"contrastive": 0.0}, loss_s=0.0, setup_s=0.0, val_image_s=0.0
    )
    return plan, timing


def _sharing_config(folds: int, num_cpus: int):
    doc = copy.deepcopy(DEMO)
    doc["losses"] = [{"name": "contrastive"}]
    doc["protocol"].update(folds=folds, fold_layout="kfold")
    doc["resources"].update(workers_per_fold=1, cpus_per_worker=1, max_concurrent_trials=1, num_cpus=num_cpus)
    return parse_config(doc)


def _one_trial(folds: int) -> StudyCount:
    """A study of one trial of ``folds`` folds, each one epoch of 100 iterations."""
    return StudyCount(
        "synthetic/contrastive",
        trials=1,
        reproductions=0,
        folds=folds,
        iters_per_epoch=100,
        eval_every=1,
        min_epochs=1,
        max_epochs=1,
    )


@pytest.mark.parametrize("cores", [2, 8])
@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_folds_in_flight_share_the_usable_cores(monkeypatch, cores, in_flight):
    """A trial's 4 folds on a local Ray of ``in_flight`` logical CPUs: that many folds run at once on the usable
    cores (not the logical CPUs), the rest wait in Ray's queue; each fold's compute is stretched by
    max(1, in flight / cores) × CONTENTION (1.0 until measured on an idle machine)."""
    monkeypatch.setattr(plan_module, "usable_cpus", lambda: cores)
    cfg = _sharing_config(folds=4, num_cpus=in_flight)
    slots = plan_module._slots(cfg, None, 1, load=0.0)
    stretch = max(1.0, in_flight / cores) * plan_module.CONTENTION
    assert slots.processes == in_flight
    assert slots.contention == pytest.approx(stretch)

    plan, timing = _fold_of_work(10.0)
    count = _one_trial(4)
    wall, cpu_seconds = plan_module._study_seconds(cfg, plan, count, timing, slots, True)
    fold = plan_module.FOLD_S + stretch * 10.0  # one fold's wall with in_flight folds at once
    rounds = 4 // in_flight  # folds queued for a logical CPU run after the ones in flight
    assert wall == pytest.approx(plan_module.STUDY_S + plan_module.TRIAL_S + rounds * fold)
    assert cpu_seconds == pytest.approx(4 * fold)  # fold wall × 1 reserved CPU each


def test_eight_folds_on_five_logical_cpus_of_two_cores(monkeypatch):
    """The issue's case: 8 folds, 5 placed at once by 5 logical CPUs, 2 real cores: 5 folds at ×2.5, then the 3
    queued ones at ×1.5 — 8 folds' compute over 2 cores, not 8 folds at ×2.5 in one go (1.6× optimistic)."""
    monkeypatch.setattr(plan_module, "usable_cpus", lambda: 2)
    cfg = _sharing_config(folds=8, num_cpus=5)
    slots = plan_module._slots(cfg, None, 1, load=0.0)
    assert slots.processes == 5
    plan, timing = _fold_of_work(10.0)
    count = _one_trial(8)
    wall, _ = plan_module._study_seconds(cfg, plan, count, timing, slots, True)
    c = plan_module.CONTENTION
    compute = (2.5 * c * 10.0 + plan_module.FOLD_S) + (1.5 * c * 10.0 + plan_module.FOLD_S)
    assert wall == pytest.approx(plan_module.STUDY_S + plan_module.TRIAL_S + compute)


def test_fixed_costs_stretch_with_the_machines_other_work(monkeypatch):
    """The orchestration's fixed costs were measured on an idle machine: with ``load`` runnable processes of other
    work on 2 cores, the sweep's own processes get ``2 / (1 + load)`` of a core's time, so each fixed cost takes
    ``(1 + load) / 2`` times as long (never less than on an idle machine)."""
    monkeypatch.setattr(plan_module, "usable_cpus", lambda: 2)
    cfg = _sharing_config(folds=4, num_cpus=4)
    plan, timing = _fold_of_work(10.0)
    count = _one_trial(4)
    idle = plan_module._slots(cfg, None, 1, load=0.0)
    loaded = plan_module._slots(cfg, None, 1, load=3.0)
    assert idle.overhead_stretch() == 1.0 and loaded.overhead_stretch() == pytest.approx(2.0)
    wall_idle, _ = plan_module._study_seconds(cfg, plan, count, timing, idle, True)
    wall_loaded, _ = plan_module._study_seconds(cfg, plan, count, timing, loaded, True)
    fixed = plan_module.STUDY_S + plan_module.TRIAL_S + plan_module.FOLD_S
    compute_idle = wall_idle - fixed
    compute_loaded = wall_loaded - 2.0 * fixed
    assert compute_idle == pytest.approx(2.0 * 10.0)  # 4 folds on 2 cores: ×2
    assert compute_loaded == pytest.approx(3.5 * 10.0)  # (4 + 3) / 2
