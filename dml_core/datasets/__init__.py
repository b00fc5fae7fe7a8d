"""Real datasets: official-layout readers, `prepare()` into parquet shards, and the per-dataset protocol.

    from dml_core.datasets import prepare, DATASETS
    prepare("cub200", src="/data/CUB_200_2011", dest="s3://bucket/cub200")   # what `dmlrc data prepare` runs

Each reader module (`cub200`, `cars196`, `sop`, `inshop`, `omniglot`) documents its layout and label convention
and exposes `records(src) -> list[Record]`, `EXPECTED` (official class/image counts) and `LABEL_CONVENTION`.
"""

from __future__ import annotations

import importlib
import os

from dml_core.datasets.protocol import SOP_SPLITS, DatasetProtocol, dataset_protocol, protocol_for_table

__all__ = ["DATASETS", "prepare", "reader", "DatasetProtocol", "dataset_protocol", "protocol_for_table", "SOP_SPLITS"]

DATASETS = ("cub200", "cars196", "sop", "inshop", "omniglot")


def reader(name: str):
    """The reader module of dataset `name`."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return importlib.import_module(f"dml_core.datasets.{name}")


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
) -> dict:
    """Read dataset `name` from its official layout at `src` and write shards + manifest to `dest` (local
    directory or s3://bucket/prefix).  Returns the manifest."""
    from dml_core import __version__
    from dml_core.shards import write_shards

    from dml_core.shards import DataFileNotFoundError

    mod = reader(name)
    if not os.path.isdir(src):
        raise DataFileNotFoundError(f"{src}: {name}: --src is not a directory")
    recs = mod.records(src)
    info = {
        "label_convention": mod.LABEL_CONVENTION,
        "official_counts": mod.EXPECTED,
        "prepared_by": f"dml-reality-check {__version__}",
    }
    return write_shards(recs, dest, dataset=name, endpoint_url=endpoint_url, info=info, overwrite=overwrite,
                        progress=progress, max_shard_bytes=max_shard_bytes, row_group_rows=row_group_rows)
