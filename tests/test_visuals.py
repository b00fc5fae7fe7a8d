"""Study visuals (pipelines.results.visuals): gallery, per-class metrics, embedding map, and their report page (fast: no
Ray cluster, no server; MLflow on a sqlite file)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from dml_core.data import synthetic
from dml_core.evaluation.metrics import retrieval_metrics
from dml_core.evaluation.stats import confidence_interval
from pipelines.names import HEADLINE_METRICS as METRICS
from pipelines.results.visuals import (
    VisualSettings,
    build_visuals,
    confusions,
    gallery_queries,
    log_study_visuals,
    map_sample,
    pca_2d,
    table_rows,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _table():
    """32 synthetic classes × 6 images; classes 16..31 are the test classes, one of them cut to a single image."""
    t = synthetic(32, 6, 16, 0)
    keep = np.ones(len(t), bool)
    keep[np.flatnonzero(t.labels == 20)[1:]] = False  # class 20: a lone image (no leave-one-out query)
    return t.take(np.flatnonzero(keep))


def _embeddings(labels: np.ndarray, noise: float, seed: int, dim: int = 12) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(labels.max() + 1, dim))
    return (centres[labels] + noise * rng.normal(size=(len(labels), dim))).astype(np.float32)


@pytest.fixture(scope="module")
def setup():
    table = _table()
    rows = table_rows(table.labels, range(16, 32))
    labels = table.labels[rows]
    assert np.array_equal(labels, table.subset(range(16, 32)).labels)  # test row i = table row rows[i]
    emb = _embeddings(labels, 0.9, 1)
    return table, rows, labels, emb, build_visuals(emb, labels, table, rows, title="t")


def test_gallery_marks_hits_by_label_and_lists_the_metrics_neighbours(setup):
    table, rows, labels, emb, v = setup
    g = v.gallery
    assert len(g["queries"]) == VisualSettings().queries and g["k"] == 8
    x = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    hits = misses = 0
    for q in g["queries"]:
        i = q["test_index"]
        assert q["table_row"] == rows[i] and q["label"] == table.labels[q["table_row"]] == labels[i]
        assert np.sum(labels == labels[i]) >= 2  # a real leave-one-out query
        sims = x[i] @ x.T
        sims[i] = -np.inf
        # the neighbours are the exact top-k by cosine similarity (ties aside), in order, never the query itself
        expect = np.argsort(-sims, kind="stable")[: g["k"]]
        got = [nb["test_index"] for nb in q["neighbours"]]
        assert i not in got and len(got) == g["k"]
        np.testing.assert_allclose([sims[j] for j in got], sims[expect], rtol=1e-5)
        for nb in q["neighbours"]:
            assert nb["table_row"] == rows[nb["test_index"]]
            assert nb["label"] == table.labels[nb["table_row"]]
            assert nb["hit"] == (table.labels[nb["table_row"]] == q["label"])
            hits += nb["hit"]
            misses += not nb["hit"]
        ap = retrieval_metrics(emb, labels, nmi=False)  # global sanity: per-query AP@R is in [0, 1]
        assert 0.0 <= q["map_at_r"] <= 1.0 and ap["map_at_r"] > 0
    assert hits and misses  # the noisy embedding shows both kinds
    assert v.gallery_png[:8] == PNG and v.map_png[:8] == PNG


def test_per_class_metrics_average_back_to_the_global_ones(setup):
    table, rows, labels, emb, v = setup
    glob = retrieval_metrics(emb, labels, nmi=False)
    classes = v.per_class["classes"]
    assert 20 not in {c["label"] for c in classes}  # the lone image is no query (PML excludes it)
    assert len(classes) == 15
    n = sum(c["queries"] for c in classes)
    assert n == len(labels) - 1
    for m in METRICS:
        weighted = sum(c["queries"] * c[m] for c in classes) / n
        assert weighted == pytest.approx(glob[m], abs=1e-12)
        assert v.per_class["global"][m] == pytest.approx(glob[m], abs=1e-12)
    # one class recomputed alone: its MAP@R is the mean AP@R of its queries within the full test set
    worst = classes[0]
    assert worst["map_at_r"] == min(c["map_at_r"] for c in classes)
    assert v.per_class["worst"][0] == worst["label"]
    csv_rows = v.per_class_csv().splitlines()
    assert (
        csv_rows[0].startswith("label,class_name,queries,precision_at_1,r_precision,map_at_r") and len(csv_rows) == 16
    )


def test_confusions_count_other_classes_within_r():
    labels = np.array([0, 0, 0, 1, 1, 2])
    knn = np.array([[3, 1, 2], [0, 5, 2], [4, 3, 0], [2, 4, 0], [3, 0, 1], [0, 1, 2]])
    r = np.array([2, 2, 2, 1, 1, 0])
    conf = confusions(labels, knn, r, top=3, block=2)
    # class 0: query 0 → 3 (class 1) within R=2; query 1 → 5 (class 2); query 2 → 4, 3 (class 1, 1)
    assert conf[0] == [(1, 3), (2, 1)]
    assert conf[1] == [(0, 1)]  # query 3 → 2 (class 0); query 4 → 3 is a hit
    assert 2 not in conf  # R = 0: no window


def test_the_same_queries_and_map_classes_for_every_loss(setup):
    table, rows, labels, _, v = setup
    other = build_visuals(_embeddings(labels, 0.3, 7, dim=20), labels, table, rows, title="other loss")
    assert [q["test_index"] for q in other.gallery["queries"]] == [q["test_index"] for q in v.gallery["queries"]]
    assert other.map_json["test_index"] == v.map_json["test_index"]
    assert gallery_queries(labels, 8, 0).tolist() == [q["test_index"] for q in v.gallery["queries"]]
    assert gallery_queries(labels, 8, 1).tolist() != gallery_queries(labels, 8, 0).tolist()
    assert len({labels[i] for i in gallery_queries(labels, 8, 0)}) == 8  # one query per class
    s = map_sample(labels, 3, 10, 0)
    assert len(s) == 10 and len(np.unique(labels[s])) <= 3


def test_pca_matches_sklearn_up_to_sign():
    from sklearn.decomposition import PCA

    x = np.random.default_rng(0).normal(size=(200, 10)) @ np.diag(np.linspace(3, 0.1, 10))
    xy, ratio = pca_2d(x)
    ref = PCA(2).fit(x)
    np.testing.assert_allclose(np.abs(xy), np.abs(ref.transform(x)), atol=1e-8)
    np.testing.assert_allclose(ratio, ref.explained_variance_ratio_, rtol=1e-8)


def test_mismatched_rows_are_refused(setup):
    table, rows, labels, emb, _ = setup
    with pytest.raises(ValueError, match="do not match"):
        build_visuals(emb, labels[::-1], table, rows)


# ------------------------------------------------------------------------------------------ logging and the report


def _fake_study(tmp_path: Path, table, test_classes, emb: np.ndarray, labels: np.ndarray, loss: str):
    """Fold checkpoint dirs as the pipeline writes them (4 fold models' test embeddings) and a plan-like object."""
    ckpts = []
    for k in range(4):
        d = tmp_path / f"{loss}-fold{k}"
        d.mkdir()
        np.save(d / "test_embeddings.npy", emb[:, 3 * k : 3 * k + 3])
        np.save(d / "test_labels.npy", labels)
        ckpts.append(str(d))
    plan = types.SimpleNamespace(
        key=f"synthetic/{loss}",
        dataset=types.SimpleNamespace(table=table, manifest=types.SimpleNamespace(test_classes=tuple(test_classes))),
    )
    from pipelines.results.embeddings import concatenated_embeddings

    concat = retrieval_metrics(
        concatenated_embeddings([emb[:, 3 * k : 3 * k + 3] for k in range(4)]), labels, nmi=False
    )
    return plan, [{"fold_checkpoints": ckpts, "test_concat_map_at_r": concat["map_at_r"]}]


def _populate(tmp_path: Path, uri: str):
    from pipelines.tracking.runs import Tracker

    table = _table()
    rows = table_rows(table.labels, range(16, 32))
    labels = table.labels[rows]
    t = Tracker.open(uri, "viz", (tmp_path / "art").as_uri())
    runs = {}
    for loss, noise in (("contrastive", 1.2), ("mpa", 0.4)):
        run_id, _ = t.get_or_create({"stage": "study", "loss": loss, "dataset": "synthetic"})
        plan, reps = _fake_study(tmp_path, table, range(16, 32), _embeddings(labels, noise, 3), labels, loss)
        seconds = log_study_visuals(t, run_id, plan, reps)
        assert seconds is not None and seconds > 0
        mean, lo, hi = confidence_interval([0.3, 0.32] if loss == "contrastive" else [0.5, 0.52])
        t.log_metrics(
            run_id,
            {"test.concat.map_at_r.mean": mean, "test.concat.map_at_r.ci_low": lo, "test.concat.map_at_r.ci_high": hi},
        )
        t.finish(run_id)
        runs[loss] = run_id
    return t, runs


def test_study_visuals_are_logged_and_the_report_puts_losses_side_by_side(tmp_path):
    from pipelines.results.report import write_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t, runs = _populate(tmp_path, uri)
    c = MlflowClient(uri)
    galleries = {}
    for loss, run_id in runs.items():
        names = {a.path for a in c.list_artifacts(run_id, "visuals")}
        assert names == {
            f"visuals/{n}"
            for n in (
                "gallery.png",
                "gallery.json",
                "per_class.csv",
                "per_class.json",
                "embedding_map.png",
                "embedding_map.json",
            )
        }
        galleries[loss] = json.loads(
            Path(c.download_artifacts(run_id, "visuals/gallery.json", str(tmp_path))).read_text()
        )
        assert c.get_run(run_id).data.metrics["visuals.seconds"] > 0
        assert "visuals.error" not in c.get_run(run_id).data.tags
    assert [q["table_row"] for q in galleries["mpa"]["queries"]] == [
        q["table_row"] for q in galleries["contrastive"]["queries"]
    ]

    paths = write_report(uri, "viz", tmp_path / "report", log_to_mlflow=False)
    page = paths["html"].read_text()
    assert "id='dataset-synthetic'" in page and "Retrieval galleries" in page
    assert page.count("alt='retrieval gallery of") == 2 and page.count("alt='embedding map of") == 2
    assert "data:image/png;base64," in page and "src='http" not in page  # one offline file
    assert "different queries" not in page
    worst = json.loads(paths["json"].read_text())["studies"][0]["worst_classes"]
    assert worst and worst[0]["map_at_r"] <= worst[-1]["map_at_r"]
    assert worst[0]["class_name"] in page
    md = paths["md"].read_text()
    assert "## Worst test classes" in md and "synthetic / contrastive" in md


def test_a_reproduction_whose_metrics_disagree_gets_no_visuals_but_a_reason(tmp_path):
    from pipelines.tracking.runs import Tracker

    table = _table()
    rows = table_rows(table.labels, range(16, 32))
    labels = table.labels[rows]
    t = Tracker.open(f"sqlite:///{tmp_path / 'm.db'}", "viz", (tmp_path / "art").as_uri())
    run_id, _ = t.get_or_create({"stage": "study"})
    plan, reps = _fake_study(tmp_path, table, range(16, 32), _embeddings(labels, 1.0, 3), labels, "x")
    reps[0]["test_concat_map_at_r"] += 0.01  # not the embedding the CI table used
    assert log_study_visuals(t, run_id, plan, reps) is None
    assert "differs from the reproduction" in t.run(run_id).data.tags["visuals.error"]
    assert t.artifact_names(run_id, "visuals") == []


def test_visuals_reuse_the_reproductions_search_instead_of_searching_again(setup, monkeypatch):
    """The reproduction's concatenated search is handed over as bytes (no pickle) and the visuals use it as is."""
    import pipelines.results.visuals as pv
    from dml_core.evaluation.metrics import retrieval_details
    from pipelines.results.embeddings import details_from_bytes, details_to_bytes

    table, rows, labels, emb, v = setup
    details = details_from_bytes(details_to_bytes(retrieval_details(emb, labels, nmi=False)))

    def no_search(*a, **k):
        raise AssertionError("a second kNN search")

    monkeypatch.setattr(pv, "_details", no_search)
    again = build_visuals(emb, labels, table, rows, title="t", details=details)
    assert again.gallery == v.gallery and again.per_class == v.per_class
