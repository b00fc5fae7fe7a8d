"""Real datasets: official-layout readers, generic image folders and CSVs, `prepare()` into parquet shards, and the
per-dataset protocol.

    from dml_core.datasets import prepare, DATASETS
    prepare("cub200", src="/data/CUB_200_2011", dest="s3://bucket/cub200")   # what `dmlrc data prepare` runs
    prepare("csv", src="s3://bucket/raw/products.csv", dest="s3://bucket/products")
    prepare("folder", src="./my_images", dest="./datasets/my_images")

Each reader module (`cub200`, `cars196`, `sop`, `inshop`, `omniglot`) documents its layout and label convention
and exposes `records(src) -> list[Record]`, `EXPECTED` (official class/image counts) and `LABEL_CONVENTION`.
`folder` and `csv` (see their docstrings and docs/datasets.md) also read straight into an `ImageTable`
(`read_image_folder`, `read_csv_dataset`).

The dataset kinds a sweep config names (`synthetic`, `omniglot`, `parquet`, `folder`, `csv` and the plug-ins of the
entry-point group `dml_reality_check.datasets`) are kept by `registry.py` (`DATASET_KIND_REGISTRY`,
`resolve_dataset_kind`, `load_dataset`), the same kind of registry as the losses' and trunks'.
"""

from __future__ import annotations

import importlib
import os
import re

from dml_core import __version__
from dml_core.datasets.protocol import SOP_SPLITS, DatasetProtocol, dataset_protocol, protocol_for_table
from dml_core.datasets.registry import DATASET_KIND_REGISTRY, DatasetKind, load_dataset, resolve_dataset_kind
from dml_core.storage import is_s3_uri

__all__ = [
    "DATASETS",
    "KINDS",
    "prepare",
    "reader",
    "read_csv_dataset",
    "read_image_folder",
    "DatasetProtocol",
    "dataset_protocol",
    "protocol_for_table",
    "SOP_SPLITS",
    "DATASET_KIND_REGISTRY",
    "DatasetKind",
    "load_dataset",
    "resolve_dataset_kind",
]

DATASETS = ("cub200", "cars196", "sop", "inshop", "omniglot")
#: Generic sources `prepare` also takes: an image folder and a dataset CSV (`folder.py`, `csv.py`).
KINDS = ("folder", "csv")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def read_csv_dataset(csv_uri, *, root=None, endpoint_url=None):
    """`dml_core.datasets.csv.read_csv_dataset` (a dataset CSV as an `ImageTable`)."""
    # the readers import pyarrow: this package's root stays light (`dmlrc` builds its parser from DATASETS and KINDS)
    from dml_core.datasets.csv import read_csv_dataset as read

    return read(csv_uri, root=root, endpoint_url=endpoint_url)


def read_image_folder(root, *, endpoint_url=None):
    """`dml_core.datasets.folder.read_image_folder` (an image folder as an `ImageTable`, fail-fast scan)."""
    # the readers import pyarrow: this package's root stays light (`dmlrc` builds its parser from DATASETS and KINDS)
    from dml_core.datasets.folder import read_image_folder as read

    return read(root, endpoint_url=endpoint_url)


def reader(name: str):
    """The reader module of dataset `name`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return importlib.import_module(f"dml_core.datasets.{name}")


def default_name(kind: str, src: str | os.PathLike) -> str:
    """A `folder` / `csv` dataset's default name: its folder's / CSV's name, reduced to [A-Za-z0-9._-]."""
    text = str(src).rstrip("/")
    base = text.rpartition("/")[2] if "/" in text else text
    if kind == "csv" and "." in base:
        base = base.rpartition(".")[0]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.")
    return name[:128] or kind


def check_name(name: str, src) -> str:
    # pyarrow: this package's root stays light (see read_csv_dataset)
    from dml_core.shards import DataError

    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DataError(
            f"{src}: dataset name {name!r} must be 1-128 characters of A-Z a-z 0-9 . _ - (starting "
            "with a letter or digit)"
        )
    return name


def prepare(
    name: str,
    src: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    endpoint_url: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_bytes: int = 128 << 20,
    row_group_rows: int = 64,
    root: str | os.PathLike | None = None,
    dataset_name: str | None = None,
) -> dict:
    """Read dataset `name` from `src` and write shards + manifest to `dest` (local directory or
    s3://bucket/prefix).  Returns the manifest.

    `name` is one of `DATASETS` (`src` = the official layout) or one of `KINDS`: `folder` (`src` = an image folder
    `<root>/<class>/<image>`, local or s3://) or `csv` (`src` = a dataset CSV, local or s3://, its images under
    `root`, by default the CSV's folder); `dataset_name` names those in the manifest (default: the folder's / the
    CSV's name).  `endpoint_url` serves whichever of `src` and `dest` is on S3."""
    # pyarrow: this package's root stays light (see read_csv_dataset)
    from dml_core.shards import DataError, DataFileNotFoundError, write_shards

    if name in KINDS:
        mod = importlib.import_module(f"dml_core.datasets.{name}")
        if root is not None and name != "csv":
            raise DataError(f"{src}: root is only for csv datasets (a folder's root is --src)")
        dataset = check_name(dataset_name if dataset_name is not None else default_name(name, src), src)
        recs = (
            mod.records(src, endpoint_url=endpoint_url)
            if name == "folder"
            else mod.records(src, root=root, endpoint_url=endpoint_url)
        )
        info = {"label_convention": mod.LABEL_CONVENTION, "source_kind": name}
        if not is_s3_uri(dest) and (is_s3_uri(src) or (root is not None and is_s3_uri(root))):
            endpoint_url = None  # it served the source; the destination is local
    else:
        if dataset_name is not None or root is not None:
            raise DataError(f"{src}: {name}: a named dataset takes neither a dataset name nor a root")
        mod = reader(name)
        if not os.path.isdir(src):
            raise DataFileNotFoundError(f"{src}: {name}: --src is not a directory")
        recs = mod.records(src)
        dataset = name
        info = {"label_convention": mod.LABEL_CONVENTION, "official_counts": mod.EXPECTED}
    info["prepared_by"] = f"dml-reality-check {__version__}"
    return write_shards(
        recs,
        dest,
        dataset=dataset,
        endpoint_url=endpoint_url,
        info=info,
        overwrite=overwrite,
        progress=progress,
        max_shard_bytes=max_shard_bytes,
        row_group_rows=row_group_rows,
    )
