"""One tiny sweep of three studies against a real ``mlflow server`` (synthetic data, 1 trial, 2 reproductions, 2 kfold
folds of 1 worker each), checked for what a sweep of several losses gives its user:

* **studies at once**: ``max_concurrent_studies`` left to its default on a local Ray of 6 CPUs (a study needs 2 →
  three at once): the study runs' time spans overlap, and every study finishes with its intervals
  (``max_concurrent_studies: 1``, studies one after another, is checked on the multi-node sweep of
  ``tests/test_faults.py``);
* **cost**: each study run's ``cost.*`` is the sum of its fold runs', and ``dmlrc report`` shows the cost column;
* **visuals**: every study run carries its gallery, per-class metrics and embedding map, matching the dataset's
  labels and the reproduction's metrics; ``dmlrc report`` and the MLflow run page are opened in headless Chromium and
  screenshotted (under the test's temp dir; the path is printed);
* **the printed link**: the MLflow link the sweep printed, taken from its output as a user copies it, opens the
  studies view in headless Chromium (no part of it masked as a secret).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_sweep import tiny_sweep

pytestmark = pytest.mark.slow

LOSSES = ["contrastive", "triplet", "ntxent"]
VISUALS = {"gallery.png", "gallery.json", "per_class.csv", "per_class.json", "embedding_map.png", "embedding_map.json"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _config(tmp: Path, uri: str) -> Path:
    return tiny_sweep(
        tmp,
        "viz",
        LOSSES,
        # default max_concurrent_studies on a local Ray of 6 CPUs: 6 // (1 trial × 2 folds × 1 worker × 1 CPU) = 3
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1, "num_cpus": 6},
        tracking={"uri": uri, "experiment": "viz-experiment"},
    )


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    from tests.mlflow_server import mlflow_server

    tmp = tmp_path_factory.mktemp("viz")
    with mlflow_server(tmp / "server") as uri:
        cfg = _config(tmp, uri)
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        out = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "sweep", str(cfg)],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=1500,
            env=env,
        )
        assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
        yield uri, tmp, cfg, out.stdout


def _studies(uri: str):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("viz-experiment")
    return c, exp, c.search_runs([exp.experiment_id], "tags.stage = 'study'")


@pytest.mark.timeout(1800)
def test_every_study_has_visuals_that_match_its_labels_and_metrics(swept):
    from pipelines.config.schema import load_config
    from pipelines.execution.preflight.study_plans import preflight

    uri, tmp, cfg_path, _ = swept
    c, exp, studies = _studies(uri)
    assert sorted(s.data.tags["loss"] for s in studies) == sorted(LOSSES)
    plan = preflight(load_config(cfg_path))[0]
    table = plan.dataset.table
    queries = {}
    for s in studies:
        sid, loss = s.info.run_id, s.data.tags["loss"]
        assert "visuals.error" not in s.data.tags, s.data.tags.get("visuals.error")
        assert {a.path.split("/")[-1] for a in c.list_artifacts(sid, "visuals")} == VISUALS
        assert s.data.metrics["visuals.seconds"] > 0
        read = lambda name: json.loads(Path(c.download_artifacts(sid, f"visuals/{name}", str(tmp))).read_text())  # noqa: E731
        gallery, per_class = read("gallery.json"), read("per_class.json")

        # marked hits are exactly the same-label neighbours, labels read back from the dataset table by row
        test_classes = set(plan.dataset.manifest.test_classes)
        for q in gallery["queries"]:
            assert table.labels[q["table_row"]] == q["label"] and q["label"] in test_classes
            assert len(q["neighbours"]) == gallery["k"]
            for nb in q["neighbours"]:
                assert nb["label"] == table.labels[nb["table_row"]] and nb["label"] in test_classes
                assert nb["hit"] == (nb["label"] == q["label"])
        queries[loss] = [q["table_row"] for q in gallery["queries"]]

        # per-class values average back (query-weighted) to the reproduction-0 test.concat metrics the CI used
        rep0 = c.search_runs(
            [exp.experiment_id],
            f"tags.stage = 'reproduction' and tags.reproduction = '0' and tags.`mlflow.parentRunId` = '{sid}'",
        )[0]
        n = sum(x["queries"] for x in per_class["classes"])
        assert n == len(plan.dataset.table.subset(test_classes))
        for m in ("map_at_r", "r_precision", "precision_at_1"):
            avg = sum(x["queries"] * x[m] for x in per_class["classes"]) / n
            assert avg == pytest.approx(rep0.data.metrics[f"test.concat.{m}"], abs=1e-9), m

    # the same queries for every loss of the dataset
    assert len({tuple(v) for v in queries.values()}) == 1 and len(queries) == len(LOSSES)


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


@pytest.mark.timeout(900)
def test_studies_run_at_once_by_default_with_their_cost(swept):
    from pipelines.results.report import write_report

    uri, tmp, _, stdout = swept
    assert "3 studies (synthetic/contrastive, synthetic/triplet, synthetic/ntxent), ≤ 3 at once" in stdout
    # progress stays per study; the final table is ranked by concatenated test MAP@R, best first, and shows the cost
    for loss in LOSSES:
        assert f"[synthetic/{loss}] done in" in stdout
    table = stdout[stdout.index("finished in") :]
    rows = [line.split("  ") for line in table.splitlines() if line.startswith("synthetic  ")]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    trained = [c for c in cells if c[1].removesuffix(" *") in LOSSES]  # " *": best at epoch 0
    assert sorted(c[1].removesuffix(" *") for c in trained) == sorted(LOSSES)
    map_at_r = [float(c[4].split()[0]) for c in trained]  # dataset, loss, concat P@1, RP, MAP@R ("mean ± half")
    assert map_at_r == sorted(map_at_r, reverse=True), table
    assert "CPU-h" in table and "GPU-h" in table
    by_stage = _runs(uri, "viz-experiment")
    _check_studies_finished(by_stage)
    spans = _spans(by_stage["study"])
    assert max(s for s, _ in spans) < min(e for _, e in spans), f"the studies did not overlap: {spans}"
    _check_cost(by_stage)

    paths = write_report(uri, "viz-experiment", tmp / "cost-report", log_to_mlflow=False)
    md = paths["md"].read_text()
    assert "## Cost" in md and "synthetic cost (CPU-h / GPU-h)" in md
    assert "Cost</h2>" in paths["html"].read_text()
    report = json.loads(paths["json"].read_text())
    study = {s["run_id"]: s for s in report["studies"]}
    for r in by_stage["study"]:
        assert study[r.info.run_id]["cost"]["cpu_seconds"] == pytest.approx(r.data.metrics["cost.cpu_seconds"])


@pytest.mark.timeout(900)
def test_every_study_records_the_untrained_reference_and_whether_its_best_is_epoch_0(swept):
    """The untrained network's test metrics: computed once for the sweep's one network, logged on every study run,
    equal to the demo's computation, a reference row in the printed table and the report; the epoch-0 tag: "true"
    exactly when every reproduction fold's best_epoch is 0."""
    from pipelines.config.schema import load_config
    from pipelines.execution.preflight.study_plans import preflight
    from pipelines.execution.studies.untrained_reference import untrained_test_metrics
    from pipelines.results.report import write_report
    from pipelines.results.study_results import EPOCH0_TAG
    from pipelines.tracking.runs import PARENT

    uri, tmp, cfg_path, stdout = swept
    by_stage = _runs(uri, "viz-experiment")
    kids: dict[str, list] = {}
    for runs in by_stage.values():
        for r in runs:
            kids.setdefault(r.data.tags.get(PARENT), []).append(r)
    logged = set()
    for study in by_stage["study"]:
        values = {k[len("untrained.") :]: v for k, v in study.data.metrics.items() if k.startswith("untrained.")}
        assert {"map_at_r", "r_precision", "precision_at_1"} <= set(values), sorted(study.data.metrics)
        logged.add(tuple(sorted(values.items())))
        reps = [r for r in kids[study.info.run_id] if r.data.tags["stage"] == "reproduction"]
        epochs = [f.data.metrics["best_epoch"] for r in reps for f in kids[r.info.run_id]]
        assert len(epochs) == 4  # 2 reproductions × 2 folds
        assert study.data.tags[EPOCH0_TAG] == str(all(e == 0 for e in epochs)).lower()
    assert len(logged) == 1, "one network: the same untrained metrics on every study"
    untrained = dict(next(iter(logged)))
    cfg = load_config(cfg_path)
    direct = untrained_test_metrics(preflight(cfg)[0], cfg.protocol.seed)
    assert untrained == pytest.approx({k: direct[k] for k in untrained}, abs=1e-6)
    assert stdout.count("untrained network on the test classes") == 1, "computed once per (dataset, network)"

    table = stdout[stdout.index("finished in") :]
    (row,) = [line for line in table.splitlines() if line.startswith("synthetic") and "untrained network" in line]
    assert row.split()[3:] == [f"{100 * untrained[k]:.2f}" for k in ("precision_at_1", "r_precision", "map_at_r")] * 2
    md = write_report(uri, "viz-experiment", tmp / "untrained-report", log_to_mlflow=False)["md"].read_text()
    assert f"| untrained network (reference) | {100 * untrained['precision_at_1']:.2f} |" in md


def _screenshot(url: str, path: Path, size: str = "1500,2200") -> None:
    profile = path.parent / f".chromium-{path.stem}"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--window-size={size}",
        "--virtual-time-budget=20000",
        f"--screenshot={path}",
        url,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert path.exists() and path.stat().st_size > 10_000, out.stderr[-3000:]


@pytest.mark.timeout(1800)
@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (Debian package `chromium`) on PATH")
def test_report_page_and_mlflow_run_page_in_headless_chromium(swept):
    from PIL import Image

    from pipelines.results.report import write_report

    uri, tmp, _, _ = swept
    paths = write_report(uri, "viz-experiment", tmp / "report", log_to_mlflow=False)
    page = paths["html"].read_text()
    assert page.count("alt='retrieval gallery of") == len(LOSSES) and "different queries" not in page

    shots = tmp / "screenshots"
    shots.mkdir()
    _screenshot(paths["html"].as_uri() + "#dataset-synthetic", shots / "report.png")
    c, exp, studies = _studies(uri)
    sid = studies[0].info.run_id
    _screenshot(
        f"{uri}/#/experiments/{exp.experiment_id}/runs/{sid}/artifacts/visuals/gallery.png",
        shots / "mlflow_run.png",
        size="1500,1100",
    )
    print(f"\nscreenshots: {shots}")
    for name in ("report.png", "mlflow_run.png"):
        im = np.asarray(Image.open(shots / name).convert("RGB"), dtype=np.int16)
        # the galleries' hit/miss frames are on screen: pixels of the green (#1a9850) and red (#d73027) frames
        green = (np.abs(im - (0x1A, 0x98, 0x50)).sum(-1) < 40).sum()
        red = (np.abs(im - (0xD7, 0x30, 0x27)).sum(-1) < 40).sum()
        assert green > 200 and red > 200, (name, green, red)


@pytest.mark.timeout(1800)
@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (Debian package `chromium`) on PATH")
def test_the_printed_mlflow_link_opens_the_studies_view(swept, tmp_path):
    from tests.test_mlflow_ui import render

    uri, _, _, stdout = swept
    links = re.findall(r"\bopen (https?://\S+)", stdout)
    assert len(links) == 1 and links[0].startswith(uri + "/"), stdout[-3000:]
    link = links[0]
    assert "***" not in link, f"the printed link is masked: {link}"
    dom = render(link, tmp_path / "printed_link.png")
    assert "Detect Issues" not in dom, "the printed link opened the GenAI overview"
    assert "share key" not in dom, "the UI could not load the studies view of the printed link"
    # the studies view: its filter (study runs only), its headline column, every study listed
    assert "tags.stage = 'study'" in dom, "the printed link did not open the studies view's filter"
    assert "test.concat.map_at_r.mean" in dom, "the printed link did not open the studies view's columns"
    missing = [loss for loss in LOSSES if f"synthetic/{loss}<" not in dom]
    assert not missing, f"studies not listed by the printed link: {missing}"
