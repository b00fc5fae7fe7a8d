"""Which classes train and which test, and how the test is scored, per dataset (docs/protocol.md §Class split).

* Default (CUB200, Cars196, SOP with `sop_split="mlrc"`, Omniglot, synthetic, image folders): the sorted unique
  labels are cut in half, first half trainval, second half test (`dml_core.splits.trainval_test_split`,
  docs/protocol.md §Class split); the test set is scored compared-to-self (every test image queries all the others).
* SOP with `sop_split="official"`: trainval = the classes of `Ebay_train.txt` (labels 0..11317), test = those of
  `Ebay_test.txt`.  MLRC's halves put class 11317 in test instead — "one class off" (docs/protocol.md §Class split).
* In-Shop: trainval = the `train` items; the test is **query vs gallery**: query images rank the gallery
  images only (`retrieval_metrics(gallery_emb, gallery_labels, query_embeddings=..., query_labels=...)`).

`dataset_protocol(dataset, labels, splits)` returns a `DatasetProtocol`; `protocol_for_table(table)` reads the
dataset name and original splits off a prepared table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dml_core.splits import trainval_test_split

__all__ = ["DatasetProtocol", "dataset_protocol", "protocol_for_table", "SOP_SPLITS"]

SOP_SPLITS = ("mlrc", "official")


@dataclass(frozen=True)
class DatasetProtocol:
    """trainval / test classes (sorted int64 arrays) and how the test set is evaluated.

    eval_mode: "self" (compared-to-self, MLRC) or "query_gallery" (In-Shop).
    """

    dataset: str
    trainval_classes: np.ndarray
    test_classes: np.ndarray
    eval_mode: str = "self"
    note: str = ""

    def query_gallery(self, splits) -> tuple[np.ndarray, np.ndarray]:
        """Row indices (query, gallery) of a test table whose original splits are `splits`."""
        splits = np.asarray(splits)
        q, g = np.flatnonzero(splits == "query"), np.flatnonzero(splits == "gallery")
        if q.size == 0 or g.size == 0:
            raise ValueError(
                f"{self.dataset}: query/gallery evaluation needs rows with split 'query' and "
                f"'gallery'; got {q.size} query and {g.size} gallery rows "
                f"(splits present: {sorted(set(splits.tolist()))})"
            )
        return q, g

    def evaluate(self, embeddings, labels, splits=None, **metric_kwargs) -> dict[str, float]:
        """Retrieval metrics of test-set `embeddings` (rows aligned with `labels` and, for In-Shop, `splits`)."""
        # torch and faiss: `dmlrc data` imports this package and never evaluates
        from dml_core.evaluation.metrics import retrieval_metrics

        if self.eval_mode == "self":
            return retrieval_metrics(embeddings, labels, **metric_kwargs)
        if splits is None:
            raise ValueError(f"{self.dataset}: query/gallery evaluation needs the rows' original splits")
        q, g = self.query_gallery(splits)
        labels = np.asarray(labels)
        return retrieval_metrics(
            embeddings[g], labels[g], query_embeddings=embeddings[q], query_labels=labels[q], **metric_kwargs
        )


def _classes_where(labels: np.ndarray, splits: np.ndarray, wanted: tuple[str, ...]) -> np.ndarray:
    return np.unique(labels[np.isin(splits, wanted)])


def dataset_protocol(dataset: str, labels, splits=None, *, sop_split: str = "mlrc") -> DatasetProtocol:
    """The protocol's class split for `dataset` given every row's label (and original split where needed)."""
    labels = np.asarray(labels, dtype=np.int64)
    if sop_split not in SOP_SPLITS:
        raise ValueError(f"sop_split must be one of {SOP_SPLITS}, got {sop_split!r}")
    if dataset == "inshop" or (dataset == "sop" and sop_split == "official"):
        if splits is None:
            raise ValueError(f"{dataset}: this split needs the rows' original splits (the manifest's 'split' column)")
        splits = np.asarray(splits)
        if len(splits) != len(labels):
            raise ValueError(f"{dataset}: {len(splits)} splits for {len(labels)} labels")
    if dataset == "inshop":
        trainval = _classes_where(labels, splits, ("train",))
        test = _classes_where(labels, splits, ("query", "gallery"))
        overlap = np.intersect1d(trainval, test)
        if overlap.size:
            raise ValueError(f"inshop: items in both train and query/gallery: {overlap[:10].tolist()}")
        return DatasetProtocol(
            "inshop", trainval, test, "query_gallery", "train items trainval; test = query vs gallery"
        )
    if dataset == "sop" and sop_split == "official":
        trainval = _classes_where(labels, splits, ("train",))
        test = _classes_where(labels, splits, ("test",))
        overlap = np.intersect1d(trainval, test)
        if overlap.size:
            raise ValueError(f"sop: classes in both Ebay_train and Ebay_test: {overlap[:10].tolist()}")
        return DatasetProtocol("sop", trainval, test, "self", "official SOP split (Ebay_train / Ebay_test classes)")
    trainval, test = trainval_test_split(labels)
    note = "sorted classes halved (MLRC)"
    if dataset == "sop":
        note += "; one class off the official SOP split (docs/protocol.md §Class split)"
    return DatasetProtocol(dataset, trainval, test, "self", note)


def protocol_for_table(table, dataset: str | None = None, *, sop_split: str = "mlrc") -> DatasetProtocol:
    """`dataset_protocol` for an ImageTable / ShardedTable (dataset name from a prepared table's manifest)."""
    name = dataset or getattr(table, "dataset", None)
    if name is None:
        raise ValueError("protocol_for_table: pass dataset= for a table that was not read from a manifest")
    return dataset_protocol(name, table.labels, table.meta.get("split"), sop_split=sop_split)
