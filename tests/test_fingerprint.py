"""The protocol fingerprint (pipelines.results.fingerprint): what it holds, what changes it and what does not, the
first differing field a refusal names, and the metric-code version it records."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from pipelines.config.presets import demo_config
from pipelines.config.schema import parse_config
from pipelines.execution.preflight.study_plans import preflight
from pipelines.execution.studies.fingerprints import study_fingerprints
from pipelines.results.fingerprint import (
    Fingerprint,
    fingerprint_of_tags,
    fingerprint_tags,
    first_difference,
)


def _doc(tmp_path, **protocol):
    doc = demo_config("fp", str(tmp_path))
    doc["losses"] = ["contrastive", "triplet"]
    doc["protocol"].update(protocol)
    return doc


def _fps(doc) -> dict[str, Fingerprint]:
    cfg = parse_config(copy.deepcopy(doc))
    return study_fingerprints(cfg, preflight(cfg))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    doc = _doc(tmp_path_factory.mktemp("fp"))
    return doc, _fps(doc)


def test_the_fields_a_comparison_needs_and_not_the_loss(base):
    doc, fps = base
    a, b = fps["synthetic/contrastive"], fps["synthetic/triplet"]
    assert a == b and a.hash == b.hash and len(a.hash) == 16  # the loss is what a comparison varies
    f = a.fields
    for key in (
        "dataset.content_sha256",
        "split.folds_sha256",
        "split.fold_layout",
        "model.trunk",
        "model.embedding_dim",
        "model.pooling",
        "model.pretrained_sha256",
        "image.size",
        "image.train_transform",
        "protocol.max_epochs",
        "protocol.iters_per_epoch",
        "protocol.eval_every",
        "protocol.patience",
        "protocol.trials",
        "protocol.sampler",
        "protocol.startup_trials",
        "protocol.train.classes_per_batch",
        "protocol.train.optimizer",
        "reproduction.seeds",
        "metrics.version",
    ):
        assert key in f, key
    assert f["reproduction.seeds"] == [1000, 2000, 3000] and f["protocol.reproductions"] == 3
    # how fast, not what: hardware-specific settings leave a study comparable
    assert "protocol.train.eval_batch_size" not in f and "protocol.train.num_workers" not in f
    assert f["protocol.max_epochs"] == 8 and f["model.trunk"] == "tiny" and f["image.size"] == 16
    assert not any(k.startswith("loss") or "loss_lr" in k for k in f)
    # one record per value: the epoch budget is protocol.max_epochs, not again under protocol.train
    assert "protocol.train.max_epochs" not in f and "protocol.train.seed" not in f


def test_a_changed_budget_is_named_with_both_values(base, tmp_path):
    doc, fps = base
    changed = _fps(_doc(tmp_path, max_epochs=3))["synthetic/contrastive"]
    assert changed.hash != fps["synthetic/contrastive"].hash
    # (field, value in the finished study, value in the new config)
    assert first_difference(changed, fps["synthetic/contrastive"]) == ("protocol.max_epochs", 8, 3)
    assert first_difference(fps["synthetic/triplet"], fps["synthetic/contrastive"]) is None


def test_a_default_written_out_equals_it_left_unset(base, tmp_path):
    """protocol.train values resolve through TrainConfig: momentum 0.9 (its default) written out changes nothing."""
    from dml_core.training.loop import TrainConfig

    doc, fps = base
    d = _doc(tmp_path)
    d["protocol"]["train"]["momentum"] = TrainConfig.momentum
    assert _fps(d)["synthetic/contrastive"].hash == fps["synthetic/contrastive"].hash
    d["protocol"]["train"]["momentum"] = 0.5
    assert first_difference(_fps(d)["synthetic/contrastive"], fps["synthetic/contrastive"])[0] == (
        "protocol.train.momentum"
    )


def test_a_changed_seed_changes_the_reproduction_seeds_and_resources_change_nothing(base, tmp_path):
    doc, fps = base
    d = _doc(tmp_path)
    d["seed"] = 5
    assert first_difference(fps["synthetic/contrastive"], _fps(d)["synthetic/contrastive"])[0] in (
        "dataset.content_sha256",  # the synthetic generator is seeded by the sweep's seed too
        "reproduction.seeds",
    )
    d = _doc(tmp_path)
    d["resources"]["max_concurrent_trials"] = 2
    assert _fps(d)["synthetic/contrastive"] == fps["synthetic/contrastive"]


def test_tags_round_trip_and_fit_mlflow(base):
    _, fps = base
    fp = fps["synthetic/contrastive"]
    tags = fingerprint_tags(fp)
    assert all(len(v) <= 8000 for v in tags.values())  # MLflow's tag value limit
    assert fingerprint_of_tags(tags) == fp and fingerprint_of_tags({}) is None
    assert Fingerprint.from_json(fp.to_json()) == fp


def test_metric_values_of_version_1_are_pinned():
    """METRICS_VERSION is recorded in every fingerprint; a change to what the metrics compute must raise it. These
    are version 1's values on a fixed input: if they change, raise METRICS_VERSION and record the new values."""
    from dml_core.evaluation.metrics import METRICS_VERSION, retrieval_metrics

    g = np.random.default_rng(0)
    labels = np.repeat(np.arange(12), 5)
    emb = g.normal(size=(60, 8)).astype(np.float32) + 1.5 * np.eye(12, 8, dtype=np.float32)[labels % 12]
    m = retrieval_metrics(emb, labels, nmi=False)
    assert METRICS_VERSION == 1
    expected = {
        "precision_at_1": 0.15,
        "r_precision": 0.1125,
        "map_at_r": 0.071875,
        "recall_at_2": 0.26666666666666666,
        "recall_at_8": 0.65,
        "ndcg_at_2": 0.1371049064255153,
        "ndcg_at_8": 0.18052625384826204,
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected, abs=1e-9)
