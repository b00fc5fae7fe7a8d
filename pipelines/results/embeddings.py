"""The reality check's evaluation of a reproduction's fold models (docs/protocol.md §Test evaluation): "concatenated" —
each fold model's embedding L2-normalised, then concatenated — and "separated" — the mean of the fold models' own
metrics.

The reproduction that ran the concatenated test search hands its neighbours to the study's visuals as bytes
(:func:`details_to_bytes`, :func:`details_from_bytes`).  Nothing here imports torch or faiss at module level: a
search trial's driver imports this module and computes no metric.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np

__all__ = [
    "concatenated_embeddings",
    "split_folds",
    "reproduction_test_metrics",
    "details_to_bytes",
    "details_from_bytes",
]


def concatenated_embeddings(parts: list[np.ndarray]) -> np.ndarray:
    """L2-normalise each fold model's embedding, then concatenate (4 × d).

    ``retrieval_metrics`` L2-normalises the concatenation again, as the reality check's tester did.
    """
    out = []
    for e in parts:
        e = np.asarray(e, dtype=np.float32)
        out.append(e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12))
    return np.concatenate(out, axis=1)


def split_folds(folds_output: np.ndarray, n_folds: int) -> list[np.ndarray]:
    """The registered model's ``output="folds"`` (fold embeddings side by side) → the per-fold raw embeddings."""
    return np.split(np.asarray(folds_output), n_folds, axis=1)


def reproduction_test_metrics(
    outcomes: list[dict[str, Any]], embeddings: list[np.ndarray], labels: list[np.ndarray]
) -> tuple[dict[str, float], Any]:
    """``test.separated.<metric>`` (mean over fold models) and ``test.concat.<metric>`` (concatenated embedding),
    with the concatenated search's ``RetrievalDetails`` (neighbours, per-query and per-class values)."""
    # torch and faiss: loaded where metrics are computed, not by the pyfunc model or a search trial's driver
    from dml_core.evaluation.metrics import retrieval_details

    out: dict[str, float] = {}
    keys = sorted(set.intersection(*(set(o["test_metrics"]) for o in outcomes)))
    for k in keys:
        out[f"test.separated.{k}"] = float(np.mean([o["test_metrics"][k] for o in outcomes]))
    for lab in labels[1:]:
        if not np.array_equal(lab, labels[0]):
            raise RuntimeError("fold models embedded the test set in different row orders")
    details = retrieval_details(concatenated_embeddings(embeddings), labels[0], normalize=True)
    for k, v in details.metrics.items():
        if isinstance(v, float) and math.isfinite(v):
            out[f"test.concat.{k}"] = float(v)
    return out, details


def details_to_bytes(details) -> bytes:
    """A ``RetrievalDetails`` as one ``.npz`` (arrays + JSON; no pickle), so the reproduction that ran the
    concatenated test search hands its neighbours to the study's visuals instead of a second search."""
    buf = io.BytesIO()
    meta = {
        "metrics": details.metrics,
        "per_class": {str(k): v for k, v in details.per_class.items()},
        "per_query": sorted(details.per_query),
    }
    np.savez(
        buf,
        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        knn_indices=details.knn_indices,
        knn_similarity=details.knn_similarity,
        **{f"q_{k}": v for k, v in details.per_query.items()},
    )
    return buf.getvalue()


def details_from_bytes(data: bytes):
    """Inverse of :func:`details_to_bytes`."""
    from dml_core.evaluation.metrics import RetrievalDetails  # torch and faiss: see reproduction_test_metrics

    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        return RetrievalDetails(
            metrics=meta["metrics"],
            knn_indices=z["knn_indices"],
            knn_similarity=z["knn_similarity"],
            per_query={k: z[f"q_{k}"] for k in meta["per_query"]},
            per_class={int(k): v for k, v in meta["per_class"].items()},
        )
