"""What a study's model retrieves, drawn: a retrieval gallery, per-class metrics and an embedding map.

At the end of a study (after its CIs are logged) :func:`log_study_visuals` takes reproduction 0's test-set
embeddings — the four fold models' embeddings, L2-normalised and concatenated, i.e. exactly the embedding behind the
"concatenated" column of the CI table (docs/protocol.md §Test evaluation) — and logs to the study run, under
``visuals/``:

* ``gallery.png`` / ``gallery.json`` — a fixed sample of test queries (one per sampled class, drawn from the test
  labels and a seed only, so every loss of a dataset shows the *same* queries), each followed by its top-k
  references; hits (same class) framed green with a ✓, misses red with a ✗, every tile captioned with its class.
  The JSON holds the query/neighbour row indices (into the test set and into the dataset table), labels and hit
  flags, so ``dmlrc report`` can put the losses side by side from MLflow alone.
* ``per_class.csv`` / ``per_class.json`` — MAP@R, R-Precision and P@1 per test class, computed by
  ``dml_core.evaluation.metrics.retrieval_details`` (the same code path as the global metrics; the query-weighted class
  means are the global values, docs/protocol.md §Metrics averages queries), plus the classes each class's queries
  retrieve instead (wrong neighbours within the first R, R = the query's class size − 1).
* ``embedding_map.png`` — PCA (2-D, numpy SVD: no extra dependency) of a seeded sample of test classes, coloured
  by class; the same classes for every loss of a dataset.

Cost: one exact kNN search of the concatenated test embeddings (``retrieval_details``, which also yields the global
metrics — checked against the reproduction's logged ``test.concat`` values); the gallery and the confusions are read
off its neighbour indices, never searched again.  Memory is the embeddings plus N × depth neighbour indices (depth =
the largest class size), nothing N × N.  Images are decoded from the dataset table by row index (``table.images[i]``:
lazy row-group reads for a sharded table), only the few dozen the gallery shows.
"""

from __future__ import annotations

import csv
import io
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray.train
from PIL import Image

from dml_core.data import decode_image
from dml_core.evaluation.metrics import retrieval_details
from dml_core.storage import open_storage
from pipelines.names import HEADLINE_METRICS, TEST_EMBEDDINGS, TEST_LABELS
from pipelines.results.embeddings import concatenated_embeddings, details_from_bytes
from pipelines.results.plotting import plt

__all__ = [
    "ARTIFACT_DIR",
    "VisualSettings",
    "StudyVisuals",
    "table_rows",
    "gallery_queries",
    "map_sample",
    "confusions",
    "build_visuals",
    "log_study_visuals",
    "reproduction_embeddings",
]

ARTIFACT_DIR = "visuals"
HIT, MISS, QUERY = "#1a9850", "#d73027", "#2b6cb0"


@dataclass(frozen=True)
class VisualSettings:
    """Sizes of the visuals (fixed per sweep, so every loss of a dataset is drawn alike)."""

    seed: int = 0
    queries: int = 8  # gallery rows
    k: int = 8  # references per query
    thumb: int = 72  # thumbnail side in pixels
    worst: int = 10  # classes listed as the worst
    confused_with: int = 3  # confusers listed per class
    map_classes: int = 12  # classes in the embedding map
    map_points: int = 1500  # at most this many points in the map


@dataclass
class StudyVisuals:
    gallery: dict[str, Any]
    per_class: dict[str, Any]
    gallery_png: bytes
    map_png: bytes
    map_json: dict[str, Any]

    def per_class_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["label", "class_name", "queries", *HEADLINE_METRICS, "confused_with"])
        for c in self.per_class["classes"]:
            w.writerow(
                [
                    c["label"],
                    c["class_name"],
                    c["queries"],
                    *(c[m] for m in HEADLINE_METRICS),
                    "; ".join(f"{x['class_name']} ({x['count']})" for x in c["confused_with"]),
                ]
            )
        return buf.getvalue()


# --------------------------------------------------------------------------------------------------- sampling


def table_rows(table_labels: np.ndarray, test_classes: Sequence[int]) -> np.ndarray:
    """Table row of each test-set row: ``table.subset(test_classes)`` keeps rows in table order, so test row i is
    table row ``table_rows(...)[i]``."""
    return np.flatnonzero(np.isin(np.asarray(table_labels), np.asarray(list(test_classes), dtype=np.int64)))


def gallery_queries(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` test-set rows, one per class, of classes with at least two images (leave-one-out queries need a
    relevant reference).  A function of (labels, seed) only — the same for every loss of a dataset."""
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    eligible = classes[counts >= 2]
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(eligible)[:n]
    return np.array([rng.choice(np.flatnonzero(labels == c)) for c in chosen], dtype=np.int64)


def map_sample(labels: np.ndarray, n_classes: int, max_points: int, seed: int) -> np.ndarray:
    """Test-set rows for the embedding map: ``n_classes`` seeded classes, at most ``max_points`` rows (sorted)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed + 1)
    chosen = rng.permutation(np.unique(labels))[:n_classes]
    rows = np.flatnonzero(np.isin(labels, chosen))
    if len(rows) > max_points:
        rows = np.sort(rng.choice(rows, max_points, replace=False))
    return rows


# --------------------------------------------------------------------------------------------------- kNN read-outs


def confusions(
    labels: np.ndarray, knn: np.ndarray, r: np.ndarray, top: int, block: int = 1 << 16
) -> dict[int, list[tuple[int, int]]]:
    """For each query class: the other classes among its queries' first-R neighbours, most frequent first.

    ``knn`` (N × depth) are the leave-one-out neighbour indices (self excluded), ``r`` (N,) each query's R.  Blocks
    of rows keep the temporaries at block × depth."""
    labels = np.asarray(labels, dtype=np.int64)
    classes = np.unique(labels)
    code = np.searchsorted(classes, labels)
    c = len(classes)
    pairs: dict[int, int] = {}
    depth = knn.shape[1]
    for a in range(0, len(labels), block):
        nb = knn[a : a + block]
        valid = (nb >= 0) & (np.arange(depth)[None, :] < r[a : a + block, None])
        qc = np.broadcast_to(code[a : a + block, None], nb.shape)
        nc = code[np.where(nb >= 0, nb, 0)]
        wrong = valid & (nc != qc)
        ids, cnt = np.unique(qc[wrong] * c + nc[wrong], return_counts=True)
        for i, n in zip(ids.tolist(), cnt.tolist()):
            pairs[i] = pairs.get(i, 0) + n
    out: dict[int, list[tuple[int, int]]] = {}
    for i, n in pairs.items():
        out.setdefault(int(classes[i // c]), []).append((int(classes[i % c]), n))
    return {k: sorted(v, key=lambda x: (-x[1], x[0]))[:top] for k, v in out.items()}


def _details(embeddings: np.ndarray, labels: np.ndarray):
    """``dml_core.evaluation.metrics.retrieval_details``: global metrics, neighbour indices (depth = max(largest R, 8))
    and per-query/per-class values, from one search."""
    # NMI (k-means) is not shown here and is the slow part on large sets; the kNN metrics are unaffected.
    return retrieval_details(embeddings, labels, normalize=True, nmi=False)


def _per_class_rows(details) -> list[dict[str, Any]]:
    """The per-class table of ``retrieval_details`` as rows (label, queries, MAP@R, RP, P@1)."""
    # Classes of a single image have no leave-one-out query (PML excludes them) and no entry.
    return [
        {"label": int(label), "queries": int(v["count"]), **{m: float(v[m]) for m in HEADLINE_METRICS}}
        for label, v in sorted(details.per_class.items())
    ]


# --------------------------------------------------------------------------------------------------- drawing


def _thumb(image, size: int) -> np.ndarray:
    im = decode_image(image)
    # Fit the longer side to ``size``: small images (Omniglot's 105 px, test data) are enlarged with nearest
    # neighbours so strokes stay crisp; large photos are reduced with a smoothing filter.
    scale = size / max(im.size)
    new = (max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale)))

    im = im.resize(new, Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS)
    out = np.full((size, size, 3), 255, np.uint8)
    a = np.asarray(im)
    y, x = (size - a.shape[0]) // 2, (size - a.shape[1]) // 2
    out[y : y + a.shape[0], x : x + a.shape[1]] = a
    return out


def _short(name: str, n: int = 16) -> str:
    """The end of a long class name (``alphabet/character``, ``..._0016``: the distinctive part is last)."""
    return name if len(name) <= n else "…" + name[-(n - 1) :]


def _png(fig, quantize: bool = False) -> bytes:
    """The figure as PNG; ``quantize`` stores it with a 256-colour palette (photo thumbnails: ~3× smaller)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    if not quantize:
        return buf.getvalue()
    im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    im.save(out, format="PNG", optimize=True)
    return out.getvalue()


def draw_gallery(gallery: dict[str, Any], images: dict[int, np.ndarray], title: str) -> bytes:
    """Rows = queries; column 0 the query (blue), then its k references (green ✓ hit / red ✗ miss)."""
    qs, k = gallery["queries"], gallery["k"]
    fig, axes = plt.subplots(
        max(1, len(qs)), k + 1, figsize=(1.15 * (k + 1), 1.45 * max(1, len(qs)) + 0.5), squeeze=False
    )
    for ax in axes.ravel():
        ax.set_xticks([]), ax.set_yticks([])
        for s in ax.spines.values():
            s.set_visible(False)
    for row, q in zip(axes, qs):
        tiles = [(q, QUERY, "query")] + [
            (nb, HIT if nb["hit"] else MISS, "✓" if nb["hit"] else "✗") for nb in q["neighbours"]
        ]
        for ax, (item, colour, mark) in zip(row, tiles):
            ax.imshow(images[item["table_row"]])
            for s in ax.spines.values():
                s.set_visible(True), s.set_color(colour), s.set_linewidth(3.5)
            ax.set_title(_short(item["class_name"], 15), fontsize=6.5, color=colour, pad=2)
            ax.text(
                0.03,
                0.97,
                mark,
                transform=ax.transAxes,
                ha="left",
                va="top",
                fontsize=7 if mark == "query" else 10,
                color="white",
                fontweight="bold",
                bbox=dict(boxstyle="square,pad=0.1", fc=colour, ec="none"),
            )
        if "map_at_r" in q:
            row[0].set_xlabel(f"AP@R {q['map_at_r']:.2f}", fontsize=6.5, labelpad=1)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=1.0, w_pad=0.2)
    return _png(fig, quantize=True)


def pca_2d(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First two principal components of ``x`` (centred; numpy SVD) and their explained-variance ratios."""
    x = np.asarray(x, dtype=np.float64)
    x = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    var = s**2
    ratio = var[:2] / max(var.sum(), 1e-30)
    # Sign convention (largest-magnitude loading positive) so the picture does not flip between runs.
    comps = vt[:2] * np.sign(vt[:2][np.arange(min(2, len(vt))), np.abs(vt[:2]).argmax(axis=1)])[:, None]
    return x @ comps.T, ratio


def draw_map(xy: np.ndarray, labels: np.ndarray, names: dict[int, str], ratio: np.ndarray, title: str) -> bytes:
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    cmap = plt.get_cmap("tab20")
    for i, c in enumerate(np.unique(labels)):
        sel = labels == c
        ax.scatter(
            xy[sel, 0],
            xy[sel, 1],
            s=10,
            color=cmap(i % 20),
            label=_short(names.get(int(c), str(c)), 22),
            alpha=0.85,
            linewidths=0,
        )
    ax.set_xlabel(f"PC 1 ({100 * ratio[0]:.1f} % of variance)")
    ax.set_ylabel(f"PC 2 ({100 * ratio[1]:.1f} %)" if len(ratio) > 1 else "PC 2")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, markerscale=1.5)
    fig.tight_layout()
    return _png(fig)


# --------------------------------------------------------------------------------------------------- assembly


def build_visuals(
    embeddings: np.ndarray,
    labels: np.ndarray,
    table,
    rows: np.ndarray,
    *,
    settings: VisualSettings = VisualSettings(),
    title: str = "",
    details=None,
) -> StudyVisuals:
    """The visuals of one embedded test set.

    ``embeddings``/``labels``: test-set rows (in ``table.subset(test_classes)`` order); ``rows[i]`` = table row of
    test row i (:func:`table_rows`); ``table``: the dataset's ImageTable / ShardedTable (images read by row);
    ``details``: the ``RetrievalDetails`` the metrics already computed for these embeddings (searched here if
    absent)."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(rows) != len(labels) or not np.array_equal(np.asarray(table.labels)[rows], labels):
        raise ValueError("test embeddings' labels do not match the dataset table's test rows")
    all_classes = np.unique(np.asarray(table.labels))
    names = {int(c): str(n) for c, n in zip(all_classes, table.class_names or [str(c) for c in all_classes])}
    if details is None:
        details = _details(embeddings, labels)
    knn = np.asarray(details.knn_indices)
    gallery = _gallery(details, knn, labels, rows, names, settings)
    needed = {q["table_row"] for q in gallery["queries"]}
    needed |= {nb["table_row"] for q in gallery["queries"] for nb in q["neighbours"]}
    images = {i: _thumb(table.images[i], settings.thumb) for i in sorted(needed)}
    gallery_png = draw_gallery(gallery, images, title)
    per_class = _per_class(details, knn, labels, names, settings)
    map_png, map_json = _embedding_map(embeddings, labels, names, settings, title)
    return StudyVisuals(gallery, per_class, gallery_png, map_png, map_json)


def _gallery(details, knn: np.ndarray, labels: np.ndarray, rows: np.ndarray, names: dict[int, str], s: VisualSettings):
    """The gallery's queries (``gallery_queries``) with their first ``s.k`` neighbours and per-query metrics."""
    sims = np.asarray(details.knn_similarity) if details.knn_similarity is not None else None
    qrows = gallery_queries(labels, s.queries, s.seed)
    k = min(s.k, knn.shape[1])
    queries = []
    for q in qrows.tolist():
        nbs = []
        for j in range(k):
            t = int(knn[q, j])
            if t < 0:
                break
            nbs.append(
                {
                    "test_index": t,
                    "table_row": int(rows[t]),
                    "label": int(labels[t]),
                    "class_name": names[int(labels[t])],
                    "hit": bool(labels[t] == labels[q]),
                    **({"similarity": float(sims[q, j])} if sims is not None else {}),
                }
            )
        pq = {m: float(details.per_query[m][q]) for m in HEADLINE_METRICS if m in details.per_query}
        queries.append(
            {
                "test_index": q,
                "table_row": int(rows[q]),
                "label": int(labels[q]),
                "class_name": names[int(labels[q])],
                "neighbours": nbs,
                **pq,
            }
        )
    return {
        "seed": s.seed,
        "k": k,
        "n_test": int(len(labels)),
        "queries": queries,
        "embedding": "reproduction 0, concatenated fold embeddings (docs/protocol.md §Test evaluation)",
    }


def _per_class(details, knn: np.ndarray, labels: np.ndarray, names: dict[int, str], s: VisualSettings):
    """Per-class metrics, worst first, each class with the classes its queries' first R neighbours confuse it with."""
    classes = _per_class_rows(details)
    counts = dict(zip(*[a.tolist() for a in np.unique(labels, return_counts=True)]))
    r = np.array([counts[int(l)] - 1 for l in labels.tolist()], dtype=np.int64)
    conf = confusions(labels, knn, r, s.confused_with)
    for c in classes:
        c["class_name"] = names[c["label"]]
        c["confused_with"] = [{"label": o, "class_name": names[o], "count": n} for o, n in conf.get(c["label"], [])]
    classes.sort(key=lambda c: (c["map_at_r"], c["label"]))
    return {
        "global": {m: float(details.metrics[m]) for m in HEADLINE_METRICS},
        "classes": classes,
        "worst": [c["label"] for c in classes[: s.worst]],
        "confusion_window": "wrong neighbours within each query's first R (R = class size - 1)",
    }


def _embedding_map(embeddings: np.ndarray, labels: np.ndarray, names: dict[int, str], s: VisualSettings, title: str):
    """The PCA map of the sampled classes' embeddings (L2-normalised) as PNG, and its JSON (rows, variance ratio)."""
    mrows = map_sample(labels, s.map_classes, s.map_points, s.seed)
    e = np.asarray(embeddings[mrows], dtype=np.float64)
    e /= np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    xy, ratio = pca_2d(e)
    map_png = draw_map(xy, labels[mrows], names, ratio, title)
    return map_png, {"seed": s.seed, "test_index": mrows.tolist(), "explained_variance_ratio": ratio.tolist()}


def reproduction_embeddings(fold_checkpoints: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated test embeddings (docs/protocol.md §Test evaluation,
    :func:`pipelines.results.embeddings.concatenated_embeddings`) and labels of a reproduction, from its folds' Ray
    Train checkpoints (local paths or ``s3://`` URIs)."""

    parts: list[np.ndarray] = []
    labels: np.ndarray | None = None
    for uri in fold_checkpoints:
        with ray.train.Checkpoint(uri).as_directory() as d:
            parts.append(np.load(Path(d) / TEST_EMBEDDINGS))
            lab = np.load(Path(d) / TEST_LABELS)
        if labels is not None and not np.array_equal(lab, labels):
            raise ValueError("fold models embedded the test set in different row orders")
        labels = lab
    if labels is None:
        raise ValueError("the reproduction has no fold checkpoints")
    return concatenated_embeddings(parts), labels


def log_study_visuals(
    tracker, run_id: str, plan, reps: list[dict[str, Any]], *, settings: VisualSettings = VisualSettings()
) -> float | None:
    """Build reproduction 0's visuals and log them to the study run under ``visuals/``; returns the seconds taken.

    A visual is a reading aid: if it cannot be built the study still succeeds; the run gets a ``visuals.error``
    tag and the reason is logged."""
    t0 = time.time()
    try:
        emb, labels = reproduction_embeddings(reps[0]["fold_checkpoints"])
        table = plan.dataset.table
        rows = table_rows(table.labels, plan.dataset.manifest.test_classes)
        details = None
        if reps[0].get("concat_details"):  # the reproduction's own concatenated search: no second search
            folder, _, name = reps[0]["concat_details"].rpartition("/")
            details = details_from_bytes(open_storage(folder).get_bytes(name))
        v = build_visuals(
            emb,
            labels,
            table,
            rows,
            settings=settings,
            details=details,
            title=f"{plan.key} — reproduction 0, concatenated embedding",
        )
        logged = reps[0].get("test_concat_map_at_r")
        if logged is not None and not math.isclose(v.per_class["global"]["map_at_r"], logged, abs_tol=1e-6):
            raise ValueError(
                f"MAP@R of the visuals' kNN {v.per_class['global']['map_at_r']} differs from the "
                f"reproduction's logged test.concat.map_at_r {logged}"
            )
        tracker.log_bytes(run_id, v.gallery_png, f"{ARTIFACT_DIR}/gallery.png")
        tracker.log_json(run_id, v.gallery, f"{ARTIFACT_DIR}/gallery.json")
        tracker.log_text(run_id, v.per_class_csv(), f"{ARTIFACT_DIR}/per_class.csv")
        tracker.log_json(run_id, v.per_class, f"{ARTIFACT_DIR}/per_class.json")
        tracker.log_bytes(run_id, v.map_png, f"{ARTIFACT_DIR}/embedding_map.png")
        tracker.log_json(run_id, v.map_json, f"{ARTIFACT_DIR}/embedding_map.json")
    except Exception as e:  # the study's results are already logged; say why the visuals are missing
        print(f"[{plan.key}] visuals not logged: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        tracker.set_tags(run_id, {"visuals.error": f"{type(e).__name__}: {e}"[:4000]})
        return None
    seconds = time.time() - t0
    tracker.log_metrics(run_id, {"visuals.seconds": seconds})
    return seconds
