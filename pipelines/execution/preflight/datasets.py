"""A sweep's datasets loaded once on the driver (every reader of :mod:`dml_core.data`), with a user's broken data
reported as one :class:`ConfigError` naming the dataset field and the file, never a traceback."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dml_core.datasets import load_dataset
from dml_core.shards import DataError, check_rows
from dml_core.storage import read_errors, s3_errors
from pipelines.config import ConfigError, DatasetSpec, redact_uri

__all__ = ["DatasetData", "load_table", "check_image_rows", "one_line"]

#: What a dataset reader raises for a bad file (dml_core.storage.read_errors): one line, never a traceback.
_READ_ERRORS = read_errors()
_S3_ERRORS = s3_errors()


@dataclass
class DatasetData:
    spec: DatasetSpec
    index: int
    table: Any  # dml_core.data.ImageTable or dml_core.shards.ShardedTable
    manifest: Any  # dml_core.splits.FoldManifest

    @property
    def num_classes(self) -> int:
        return int(len(np.unique(self.table.labels)))


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (KeyError, TypeError, IndexError, AttributeError, zipfile.BadZipFile, EOFError)):
        text = f"{type(e).__name__}: {text}"
    return redact_uri(text)


def _bad_zip(root: str) -> str | None:
    """The first zip under ``root`` that zipfile cannot open (BadZipFile does not say which file it was)."""
    for z in sorted(Path(root).rglob("*.zip")) if Path(root).is_dir() else [Path(root)]:
        try:
            with zipfile.ZipFile(z) as f:
                bad = f.testzip()
            if bad is not None:
                return f"{z}: entry {bad!r} fails its CRC check"
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"{z}: {one_line(e)}"
    return None


def load_table(spec: DatasetSpec, where: str):
    """The dataset's rows, read by its kind's loader (:func:`dml_core.datasets.load_dataset`: a built-in reader or
    a plug-in's), its first ``spec.classes`` classes if set."""
    try:
        if spec.kind != "synthetic" and not spec.path.startswith("s3://") and not Path(spec.path).exists():
            raise ConfigError(f"{where}.path", f"{spec.path!r} does not exist (cwd {os.getcwd()})")
        table = load_dataset(spec.kind, **spec.loader_arguments())
    except ConfigError:
        raise
    except MemoryError:
        raise ConfigError(where, "does not fit in memory") from None
    except _READ_ERRORS as e:
        field_name = f"{where}.path" if spec.kind != "synthetic" else where
        detail = one_line(e)
        if spec.kind == "omniglot" and isinstance(e, (zipfile.BadZipFile, EOFError)):
            detail = _bad_zip(spec.path) or detail
        elif _S3_ERRORS and isinstance(e, _S3_ERRORS):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
            detail = (
                f"S3 at {endpoint} is not reachable or refuses access ({detail}); set AWS_ENDPOINT_URL and "
                "credentials for a non-AWS server"
            )
        raise ConfigError(field_name, f"cannot read the {spec.kind} dataset: {detail}") from None
    if spec.classes is not None:
        classes = np.unique(table.labels)
        if spec.classes > len(classes):
            raise ConfigError(f"{where}.classes", f"{spec.classes} > the dataset's {len(classes)} classes")
        table = table.subset(classes[: spec.classes])
    return table


def check_image_rows(uri: str, where: str) -> None:
    """Every row of a prepared parquet dataset, before any worker reads it: ``dml_core.shards.check_rows`` (the
    manifest, shard hashes, row-group layout, each row's index and image header).  A bad row would otherwise fail
    only inside a training worker, minutes in."""
    try:
        check_rows(uri)
    except DataError as e:
        raise ConfigError(f"{where}.path", one_line(e)) from None
