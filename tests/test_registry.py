"""Models in MLflow's format, registered: naming and dataset digests, a pyfunc model that returns the fold models'
embeddings, studies logging one dataset at once.

:func:`parquet_dataset`, :func:`run_registered_sweep` and :func:`check_registered` (one registered version per
study with its tags, checked against a tiny real sweep) are run by ``tests/test_reeval.py``, whose sweep against an
``mlflow server`` on PostgreSQL runs every registration check before it re-evaluates the models: one sweep for both.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_sweep import tiny_sweep

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ fast units


def test_registered_model_name_is_readable_and_uri_safe():
    from pipelines.tracking.model_registry import registered_model_name

    assert registered_model_name("mlrc", "cub200", "sec:triplet") == "dmlrc.mlrc.cub200.sec-triplet"
    assert "/" not in registered_model_name("a/b", "c d", "e")


def test_fold_weights_holding_pickled_objects_are_refused_without_torchs_advice(tmp_path):
    """A reproduction fold's ``model.pt`` (read to register the model) and a registered model's fold file (read when
    the pyfunc model loads) that hold pickled objects are refused saying what they hold, never with torch's advice to
    retry with ``weights_only=False``."""
    import pickle
    import types

    from pipelines.tracking.model_registry import _read_fold_checkpoint
    from pipelines.tracking.pyfunc_model import FoldEnsembleEmbedder
    from tests.test_weights_refusal import _no_advice, _pickled

    (tmp_path / "ckpt").mkdir()
    _pickled(tmp_path / "ckpt" / "model.pt")
    with pytest.raises(pickle.UnpicklingError, match="^refused: the file holds more than tensors") as info:
        _read_fold_checkpoint(str(tmp_path / "ckpt"))
    _no_advice(str(info.value))

    spec = tmp_path / "embedder.json"
    spec.write_text(json.dumps({"folds": 1, "model_kwargs": {"trunk": "tiny", "embedding_dim": 8}}))
    context = types.SimpleNamespace(artifacts={"embedder": str(spec), "fold_0": str(_pickled(tmp_path / "f0.pt"))})
    with pytest.raises(pickle.UnpicklingError, match="^refused: the file holds more than tensors") as info:
        FoldEnsembleEmbedder().load_context(context)
    _no_advice(str(info.value))


def test_dataset_digest_is_the_manifest_hash_or_the_generator_parameters(tmp_path):
    from pipelines.config.schema import ParquetDataset, SyntheticDataset
    from pipelines.tracking.datasets import dataset_info

    a = dataset_info(
        SyntheticDataset(name="s", kind="synthetic", image_size=16, num_classes=8, per_class=4, seed=1), None
    )
    b = dataset_info(
        SyntheticDataset(name="s", kind="synthetic", image_size=16, num_classes=8, per_class=4, seed=2), None
    )
    assert a["digest"] != b["digest"] and len(a["digest"]) == 32 and a["sha256"].startswith(a["digest"])

    class T:  # a ShardedTable's manifest is all the digest reads
        manifest = {"dataset": "x", "shards": [{"sha256": "00"}], "num_images": 1, "classes": [{"label": 0}]}

    p = dataset_info(ParquetDataset(name="x", kind="parquet", image_size=16, path="/d"), T())
    T.manifest = {**T.manifest, "shards": [{"sha256": "01"}]}
    q = dataset_info(ParquetDataset(name="x", kind="parquet", image_size=16, path="/d"), T())
    assert p["digest"] != q["digest"]


# ------------------------------------------------------------------------------------------------ shared set-up


def parquet_dataset(
    dest: Path,
    *,
    num_classes: int = 32,
    per_class: int = 8,
    image_size: int = 16,
    permute_test_fraction: float = 0.0,
    seed: int = 0,
    endpoint_url: str | None = None,
) -> str:
    """Synthetic images written as parquet shards (``dmlrc data`` format) at ``dest`` (a path or s3:// URI).

    ``permute_test_fraction``: that fraction of the rows of the test classes (second half of the classes, as
    ``trainval_test_split`` cuts) get their labels shuffled among themselves — a degraded copy of the test data.
    """
    from PIL import Image

    from dml_core.data import synthetic
    from dml_core.shards import Record, write_shards

    table = synthetic(num_classes, per_class, image_size, 0)
    labels = np.asarray(table.labels).copy()
    if permute_test_fraction:
        rng = np.random.default_rng(seed)
        test = np.flatnonzero(labels >= np.unique(labels)[int(0.5 * len(np.unique(labels)))])
        pick = rng.choice(test, size=int(permute_test_fraction * len(test)), replace=False)
        labels[pick] = labels[rng.permutation(pick)]

    def png(img):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        return buf.getvalue()

    records = [
        Record(
            f"img_{i:05d}.png",
            int(labels[i]),
            f"class_{int(labels[i]):03d}",
            "all",
            (lambda img=table.images[i]: png(img)),
        )
        for i in range(len(labels))
    ]
    write_shards(
        records,
        str(dest),
        dataset="synthetic-shards",
        endpoint_url=endpoint_url,
        progress=False,
        row_group_rows=32,
        max_shard_bytes=20_000,
    )
    return str(dest)


def sweep_config(tmp_path: Path, tracking_uri: str, data_uri: str, *, name: str = "reg") -> Path:
    # two k-fold folds: a registered model of several fold models is the subject here; the protocol's four mlrc
    # folds are tests/test_sweep.py's PostgreSQL sweep's
    return tiny_sweep(
        tmp_path,
        name,
        ["contrastive"],
        datasets=[{"name": "shapes", "kind": "parquet", "path": data_uri, "image_size": 16}],
        model={"trunk": "tiny", "embedding_dim": 8, "freeze_bn": False},
        protocol={
            "iters_per_epoch": 2,
            "max_epochs": 1,
            "train": {"classes_per_batch": 4, "m": 4, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
        },
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1},
        tracking={"uri": tracking_uri, "experiment": f"{name}-experiment"},
    )


def run_cli(args: list[str], cwd: Path, timeout: int = 900, extra_env: dict | None = None):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def run_registered_sweep(tmp_path: Path, uri: str, *, name: str = "reg") -> tuple[str, str]:
    """Prepare the parquet data set, run the sweep; returns (data URI, experiment name)."""
    data = parquet_dataset(tmp_path / "data")
    cfg = sweep_config(tmp_path, uri, data, name=name)
    out = run_cli(["sweep", str(cfg)], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert "registered 2 reproduction models as dmlrc." in out.stdout, out.stdout[-3000:]
    return data, f"{name}-experiment"


# ------------------------------------------------------------------------------------------------ slow


def check_registered(uri: str, experiment: str, data: str) -> None:
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    from dml_core.data import ImageDataset, eval_transform, read_parquet_manifest
    from dml_core.models import build_model
    from dml_core.splits import FoldManifest
    from dml_core.training.loop import embed
    from pipelines.names import ALIAS
    from pipelines.names import HEADLINE_METRICS as HEADLINE
    from pipelines.results.embeddings import concatenated_embeddings
    from pipelines.tracking.model_registry import fluent_tracking, registered_model_name
    from pipelines.tracking.runs import search_all

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert json.loads(exp.tags["mlflow.sharedViewState.dmlrc-studies"])["orderByKey"] == (
        "metrics.`test.concat.map_at_r.mean`"
    ), "the sweep did not store the studies view its printed link opens"
    study = search_all(c, exp.experiment_id, "tags.stage = 'study'")
    assert len(study) == 1
    study = study[0]
    # dataset inputs on the study run and every fold run, digest = manifest hash
    table = read_parquet_manifest(data)
    import hashlib

    sha = hashlib.sha256(json.dumps(table.manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    ds = [d.dataset for d in study.inputs.dataset_inputs]
    assert [(d.name, d.digest) for d in ds] == [("shapes", sha[:32])]
    folds = search_all(c, exp.experiment_id, "tags.stage = 'fold'")
    assert folds and all([d.dataset.digest for d in f.inputs.dataset_inputs] == [sha[:32]] for f in folds)
    assert (
        "test.concat.map_at_r" in study.data.tags["mlflow.note.content"]
        or "map_at_r" in study.data.tags["mlflow.note.content"]
    )

    name = registered_model_name(experiment, "shapes", "contrastive")
    versions = c.search_model_versions(f"name = '{name}'")
    assert len(versions) == 1, versions  # one version per study
    v = versions[0]
    assert c.get_model_version_by_alias(name, ALIAS).version == v.version
    t = v.tags
    assert t["study_run_id"] == study.info.run_id and v.run_id == study.info.run_id
    assert t["sweep"] == "reg" and t["git_commit"] == study.data.tags["git_commit"]
    assert t["folds_hash"] == study.data.tags["folds_hash"] and t["dataset_digest"] == sha
    reps = json.loads(t["reproductions"])
    assert [r["reproduction"] for r in reps] == [0, 1] and t["seeds"] == ",".join(str(r["seed"]) for r in reps)
    assert t["seed"] == str(reps[0]["seed"])
    for mode in ("concat", "separated"):
        for metric in HEADLINE:
            for part in ("mean", "ci_low", "ci_high"):
                assert float(t[f"test.{mode}.{metric}.{part}"]) == pytest.approx(
                    study.data.metrics[f"test.{mode}.{metric}.{part}"], abs=1e-12
                )

    # pyfunc predict == the fold models' embeddings (fold checkpoints read back from the models/ artifacts)
    manifest = FoldManifest.from_json(Path(c.download_artifacts(study.info.run_id, "folds.json")).read_text())
    test = ImageDataset(table.subset(manifest.test_classes), eval_transform(16))
    x = torch.stack([test[i][0] for i in range(len(test))]).numpy()
    with fluent_tracking(uri):  # models:/ URIs resolve through it; restored after (no leak to other tests)
        model = mlflow.pyfunc.load_model(f"models:/{name}@{ALIAS}")
    out = model.predict(x)
    folds_out = model.predict(x, params={"output": "folds"})
    parts = []
    for k in range(len(manifest.folds)):
        state = torch.load(c.download_artifacts(study.info.run_id, f"models/fold_{k}.pt"), weights_only=True)
        m = build_model(**state["model_kwargs"])
        m.load_state_dict(state["model"])
        parts.append(embed(m, test, batch_size=64)[0].numpy())
    np.testing.assert_allclose(folds_out, np.concatenate(parts, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, concatenated_embeddings(parts), rtol=1e-5, atol=1e-6)
    assert len(parts) == 2 and out.shape == (len(test), 2 * 8)


def test_registered_pyfunc_model_predicts_the_fold_models_embeddings_without_unpickling(tmp_path):
    """Fast: pipelines.tracking.model_registry on a sqlite store from 4 untrained fold checkpoints (no Ray cluster, no
    server)."""
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient

    from dml_core.models import build_model
    from pipelines.names import ALIAS
    from pipelines.results.embeddings import concatenated_embeddings
    from pipelines.tracking.model_registry import fluent_tracking
    from tests.test_mlflow_ui import _fake_study

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp_id, run_id, name = _fake_study(tmp_path, uri, "unit")
    c = MlflowClient(uri)
    assert c.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    from pipelines.tracking.ui import studies_view_state

    view = json.loads(c.get_experiment(exp_id).tags["mlflow.sharedViewState.dmlrc-studies"])
    assert view == studies_view_state() and view["selectedColumns"][0] == "metrics.`test.concat.map_at_r.mean`"
    run = c.get_run(run_id)
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["shapes"]
    assert "map_at_r" in run.data.tags["mlflow.note.content"]
    assert "shapes/contrastive" in c.get_experiment(exp_id).tags["mlflow.note.content"]
    (v,) = c.search_model_versions(f"name = '{name}'")
    assert v.run_id == run_id and v.tags["seed"] == "1003" and v.tags["study_run_id"] == run_id
    assert float(v.tags["test.concat.map_at_r.ci_low"]) == 0.45
    with fluent_tracking(uri):  # models:/ URIs resolve through the fluent store; restored after
        model = mlflow.pyfunc.load_model(f"models:/{name}@{ALIAS}")
        # the model is the code file + state dicts: no pickle in its artifacts
        local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@{ALIAS}"))
    assert not list(local.rglob("*.pkl")) and (local / "pyfunc_model.py").exists()
    x = np.random.default_rng(0).standard_normal((5, 3, 16, 16)).astype(np.float32)
    parts = []
    for k in range(4):
        state = torch.load(tmp_path / f"ckpt{k}" / "model.pt", weights_only=True)
        m = build_model(**state["model_kwargs"])
        m.load_state_dict(state["model"])
        with torch.no_grad():
            parts.append(m.eval()(torch.from_numpy(x)).numpy())
    np.testing.assert_allclose(model.predict(x, params={"output": "folds"}), np.concatenate(parts, 1), atol=1e-6)
    np.testing.assert_allclose(model.predict(x), concatenated_embeddings(parts), atol=1e-6)
    # no input schema: predict takes images in several forms and checks them itself
    assert model.metadata.get_input_schema() is None and "uint8" in model.metadata.metadata["input"]
    assert [p.name for p in model.metadata.get_params_schema().params] == ["output", "batch_size"]
    check_image_inputs(model, tmp_path / "images")

    # what it needs to load elsewhere travels with it: this package as a wheel named by file and sha256
    import hashlib

    reqs = (local / "requirements.txt").read_text().split()
    (ours,) = [r for r in reqs if "dml_reality_check-" in r]
    wheel = local / ours.split("#")[0][len("file:") :]
    assert ours == f"file:artifacts/{wheel.name}#sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}", ours
    assert not [r for r in reqs if r.startswith("dml-reality-check")], reqs


def check_image_inputs(model, folder: Path) -> None:
    """``predict`` on images as users have them (encoded bytes, paths, uint8 arrays, PIL images) equals ``predict``
    on the model's own preprocessing of them; bad input is one line that does not print the input."""
    from PIL import Image

    from pipelines.tracking.pyfunc_model import preprocess

    folder.mkdir()
    rng = np.random.default_rng(1)
    paths = []
    for i, (w, h, fmt) in enumerate([(24, 20, "PNG"), (16, 16, "JPEG"), (40, 18, "PNG")]):
        paths.append(folder / f"im{i}.{fmt.lower()}")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1], fmt)
    spec = model.unwrap_python_model().spec
    raw = [p.read_bytes() for p in paths]
    want = model.predict(preprocess(raw, spec["image_size"], spec["preprocessing"]))
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    for given in (raw, [str(p) for p in paths], paths, arrays, [Image.open(p) for p in paths]):
        np.testing.assert_allclose(model.predict(given), want, atol=1e-5)
    np.testing.assert_allclose(model.predict(raw[2]), want[2:], atol=1e-5)  # one image alone
    np.testing.assert_allclose(model.predict(np.stack([arrays[0]] * 2)), want[[0, 0]], atol=1e-5)  # (B, H, W, C)
    gray = np.asarray(Image.open(paths[0]).convert("L"))
    assert model.predict([gray]).shape == want[:1].shape
    secret = b"\x00not-an-image-payload" * 20
    with pytest.raises(ValueError) as e:
        model.predict([raw[0], secret])
    assert str(e.value).startswith(f"image 1 ({len(secret)} bytes): UnidentifiedImageError"), str(e.value)
    assert "not-an-image" not in str(e.value)
    with pytest.raises(ValueError, match=r"^a float array is taken as a preprocessed batch \(B, 3, 16, 16\)"):
        model.predict(np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"^image 0 is a int: images are encoded bytes"):
        model.predict([3])


def test_studies_logging_the_same_new_dataset_at_once_do_not_collide(tmp_path):
    """Studies start in threads of one driver, and several train on the same dataset: each logs it as its study
    run's input at the same moment.  MLflow's SQL store looks the dataset up, then inserts it, so two inserts of a
    new (name, digest) could race to the table's unique key (`UNIQUE constraint failed: datasets...`, found by a
    clean-clone `make test` in a sweep of three studies at once).  Each round uses a fresh experiment, so the
    dataset is new."""
    import threading

    from mlflow import MlflowClient

    from pipelines.tracking.datasets import log_dataset_input

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    info = {
        "name": "synthetic",
        "digest": "0" * 32,
        "sha256": "0" * 64,
        "kind": "synthetic",
        "uri": 'synthetic:{"seed": 1}',
        "profile": {"num_classes": 4},
    }
    for rnd in range(6):
        exp = client.create_experiment(f"race-{rnd}")
        runs = [client.create_run(exp).info.run_id for _ in range(4)]
        barrier, errors = threading.Barrier(len(runs)), []

        def log(run_id):
            barrier.wait()
            try:
                log_dataset_input(client, run_id, info, "study")
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=log, args=(r,)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        for r in runs:
            assert [d.dataset.name for d in client.get_run(r).inputs.dataset_inputs] == ["synthetic"]
