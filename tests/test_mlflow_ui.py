"""What a user sees in MLflow 3's UI: headless Chromium against a real ``mlflow server``.

The state is written by the real code (``pipelines.tracking.model_registry``: experiment kind, dataset input, study
note, pyfunc models, registered version) from fold checkpoints of untrained models, so no sweep is needed; the version's
``reeval.status`` is set as ``dmlrc reeval`` sets it.  Checks, on the rendered DOM (``chromium --dump-dom``):

* the experiment page opens on the training-runs view (the study run is listed), not on the GenAI overview;
* the study run's page shows its dataset and its registered model;
* the registered model's page lists its version with ``reeval.status``;
* a zoo-sized experiment (24 study runs, each with trial runs under it) opens, through the sweep's printed link, on
  the studies view: the study runs only, best test MAP@R first, the headline test metrics shown as columns without
  the user adding any.

Screenshots (``*.png``) are saved under the test's temp dir.  The link a real sweep prints is opened the same way by
``tests/test_studies_sweep.py``; here, quickly, the printed text keeps the link's own parameters while the user's
secrets are still masked.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (Debian package `chromium`)"
)


def render(url: str, png: Path, *, wait_ms: int = 20000) -> str:
    """Load ``url`` in headless Chromium, save a screenshot to ``png``; return the rendered DOM."""
    base = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1500,1000",
        f"--virtual-time-budget={wait_ms}",
        f"--user-data-dir={png.parent / ('chrome-' + png.stem)}",
    ]
    subprocess.run(base + [f"--screenshot={png}", url], capture_output=True, timeout=180, check=False)
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    (png.with_suffix(".html")).write_text(dom.stdout)
    return dom.stdout


@pytest.mark.parametrize(
    "tracking_uri, shown",
    [
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("https://alice:hunter2@mlflow.example.org", "https://alice:***@mlflow.example.org"),
        ("sqlite:////data/runs/mlflow.db", "sqlite:////data/runs/mlflow.db"),
    ],
)
def test_the_printed_link_keeps_its_own_parameters_and_only_the_users_secret_is_masked(tracking_uri, shown):
    from pipelines.config.uris import redact_uri
    from pipelines.execution.sweep import SweepOutcome
    from pipelines.tracking.ui import STUDIES_VIEW_KEY, experiment_url

    outcome = SweepOutcome("s", Path("runs/s"), tracking_uri, "e", "7", [], 1.0)
    printed = redact_uri(outcome.ui_command())  # what `dmlrc sweep` and `dmlrc demo` print
    assert "hunter2" not in printed
    if not shown.startswith("http"):  # a store: `dmlrc ui` serves it and prints the link (tests/test_cli_ui.py)
        assert printed == f"dmlrc ui --tracking-uri {shown} --experiment e", printed
        return
    assert printed.endswith(experiment_url(shown, "7")), printed
    assert f"viewStateShareKey={STUDIES_VIEW_KEY}&workflowType=machine_learning" in printed


@pytest.mark.parametrize(
    "text, masked",
    [
        ("https://h/x?api_key=abc123&page=2", "https://h/x?api_key=***&page=2"),
        ("https://h/x?key=AIzaSy0&q=1", "https://h/x?key=***&q=1"),
        ("http://h/?token=t0k;sig=s1g", "http://h/?token=***;sig=***"),
        ("https://h/a?apiKey=a&x-api-key=b&access_token=c", "https://h/a?apiKey=***&x-api-key=***&access_token=***"),
        ("postgresql://u@h/db?password=pw&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F&X-Amz-Signature=ab&X-Amz-Security-Token=cd&X-Amz-Date=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***&X-Amz-Date=1",
        ),
        (
            "https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIA&Expires=1",
            "https://b.s3.amazonaws.com/k?AWSAccessKeyId=***&Expires=1",
        ),
        (
            "https://acct.blob.core.windows.net/c?sv=2020&sig=abc",
            "https://acct.blob.core.windows.net/c?sv=2020&sig=***",
        ),
        ("http://h/?client_secret=x&author=me&sortKey=name", "http://h/?client_secret=***&author=me&sortKey=name"),
    ],
)
def test_redaction_masks_secret_query_values_and_leaves_other_parameters(text, masked):
    from pipelines.config.uris import redact_uri

    assert redact_uri(text) == masked


def _fake_study(tmp: Path, uri: str, experiment: str):
    """A study run + registered version written by pipelines.tracking.model_registry from 4 untrained fold
    checkpoints."""
    import torch

    from dml_core.models import build_model
    from pipelines.config.schema import SyntheticDataset
    from pipelines.tracking.model_registry import on_study_end, on_study_start
    from pipelines.tracking.runs import Tracker
    from pipelines.tracking.ui import set_experiment_ui

    kwargs = {"trunk": "tiny", "embedding_dim": 8, "freeze_bn": False}
    ckpts = []
    for k in range(4):
        d = tmp / f"ckpt{k}"
        d.mkdir(parents=True)
        torch.save(
            {"model": build_model(**kwargs).state_dict(), "model_kwargs": kwargs, "loss_name": "contrastive"},
            d / "model.pt",
        )
        ckpts.append(str(d))
    t = Tracker.open(uri, experiment)
    set_experiment_ui(t.client, t.experiment_id)  # what run_sweep does once
    run_id, _ = t.get_or_create(
        {"sweep": "ui", "study": "shapes/contrastive", "stage": "study"}, run_name="shapes/contrastive"
    )
    t.set_tags(run_id, {"loss": "contrastive", "dataset": "shapes", "git_commit": "abc", "folds_hash": "f" * 64})
    spec = SyntheticDataset(name="shapes", kind="synthetic", image_size=16, num_classes=8, per_class=4, seed=0)
    plan = SimpleNamespace(
        key="shapes/contrastive",
        loss=SimpleNamespace(name="contrastive"),
        dataset=SimpleNamespace(spec=spec, table=None),
    )
    on_study_start(t, run_id, plan)
    ci = {
        m: {k: (0.5, 0.45, 0.55) for k in ("precision_at_1", "r_precision", "map_at_r")}
        for m in ("concat", "separated")
    }
    t.log_metrics(run_id, {f"test.{m}.{k}.mean": v[0] for m, d in ci.items() for k, v in d.items()})
    reps = [{"__reproduction__": 0, "seed": 1003, "fold_checkpoints": ckpts, "test_concat_map_at_r": 0.5}]
    ref = on_study_end(t, study_run_id=run_id, experiment=experiment, sweep="ui", plan=plan, reps=reps, ci=ci)
    t.finish(run_id)
    name, version = ref.split("/")
    t.client.set_model_version_tag(name, version, "reeval.status", "ok")
    return t.experiment_id, run_id, name


def check_ui(uri: str, experiment_id: str, run_id: str, model_name: str, out: Path, dataset: str = "shapes") -> None:
    from pipelines.tracking.ui import experiment_url

    exp_dom = render(experiment_url(uri, experiment_id), out / "experiment.png")
    # the runs view lists the study run; the GenAI overview shows trace usage ("Detect Issues", "Tool calls")
    assert "Detect Issues" not in exp_dom and "Tool calls" not in exp_dom, "experiment opened on the GenAI overview"
    assert "shapes/contrastive" in exp_dom, "experiment page does not list the study run"
    run_dom = render(f"{uri}/#/experiments/{experiment_id}/runs/{run_id}", out / "study_run.png")
    assert dataset in run_dom and model_name in run_dom, "run page lacks the dataset or the registered model"
    model_dom = render(f"{uri}/#/models/{model_name}", out / "registered_model.png")
    assert "Version 1" in model_dom or ">1<" in model_dom, "registered model page lists no version"
    assert "reeval.status" in model_dom, "registered model page does not show reeval.status"


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory):
    """One ``mlflow server`` (sqlite) for the module's browser tests; each writes its own experiment."""
    from tests.mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("server")) as uri:
        yield uri


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_chromium
def test_ui_opens_on_runs_and_shows_dataset_model_and_reeval_status(tmp_path, server_uri):
    exp_id, run_id, name = _fake_study(tmp_path, server_uri, "ui-experiment")
    check_ui(server_uri, exp_id, run_id, name, tmp_path)


def _zoo_experiment(uri: str, n_studies: int) -> tuple[str, list[tuple[str, float]]]:
    """``n_studies`` study runs as a sweep writes them (tags, headline test metrics, two trial runs nested under each),
    the experiment prepared by the sweep's own :func:`set_experiment_ui`; returns the experiment id and
    (study, test MAP@R) pairs.  The MAP@R values are shuffled against the creation order, so that a view sorted by
    creation time (the UI's default) cannot pass for one sorted by the metric."""
    import random

    from pipelines.tracking.runs import Tracker
    from pipelines.tracking.ui import set_experiment_ui

    t = Tracker.open(uri, "zoo-ui")
    set_experiment_ui(t.client, t.experiment_id)
    values = [round(0.20 + 0.01 * i, 2) for i in range(n_studies)]
    random.Random(0).shuffle(values)
    studies = []
    for i, v in enumerate(values):
        study = f"omniglot/loss{i:02d}"
        run_id, _ = t.get_or_create({"sweep": "zoo", "study": study, "stage": "study"}, run_name=study)
        t.log_metrics(
            run_id,
            {
                "test.concat.map_at_r.mean": v,
                "test.concat.r_precision.mean": v + 0.1,
                "test.concat.precision_at_1.mean": v + 0.3,
            },
        )
        for k in range(2):
            trial_id, _ = t.get_or_create(
                {"sweep": "zoo", "study": study, "stage": "trial", "trial_id": f"t{k}"},
                run_name=f"trial {k}",
                parent=run_id,
            )
            t.log_metrics(trial_id, {"val_map_at_r_mean": v / 2})
            t.finish(trial_id)
        t.finish(run_id)
        studies.append((study, v))
    return t.experiment_id, studies


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_chromium
def test_runs_view_of_a_zoo_sized_sweep_ranks_studies_by_test_map_at_r(tmp_path, server_uri):
    from pipelines.tracking.ui import experiment_url

    exp_id, studies = _zoo_experiment(server_uri, 24)
    dom = render(experiment_url(server_uri, exp_id), tmp_path / "studies_view.png")
    assert "Detect Issues" not in dom, "experiment opened on the GenAI overview"
    assert "share key" not in dom, "the UI could not load the studies view"
    # the headline metric columns are there without column set-up, and the values of the best study are shown
    for m in ("map_at_r", "r_precision", "precision_at_1"):
        assert f"test.concat.{m}.mean" in dom, f"no test.concat.{m}.mean column in the runs view"
    best_study, best = max(studies, key=lambda s: s[1])
    assert f">{best}<" in dom and f">{round(best + 0.3, 2)}<" in dom, "the best study's test metrics are not shown"
    # study runs only (no trial rows), every one listed, best test MAP@R first
    assert "trial 0" not in dom, "trial runs listed in the studies view"
    positions = {s: dom.find(s + "<") for s, _ in studies}
    assert all(p >= 0 for p in positions.values()), [s for s, p in positions.items() if p < 0]
    shown = sorted(positions, key=positions.get)
    assert shown == [s for s, _ in sorted(studies, key=lambda s: -s[1])], "studies not ordered by test MAP@R"
