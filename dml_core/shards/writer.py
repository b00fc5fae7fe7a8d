"""Writing a dataset as parquet shards plus `manifest.json` (`write_shards`, what `dmlrc data prepare` runs).

Rows are sorted by (label, relpath) so each class is contiguous; every image is fully decoded before it is stored;
shards are staged and moved into place (or uploaded) only once every image decoded, and the manifest goes last, so a
failed run leaves nothing a reader would take for a dataset."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dml_core.shards.cache import sha256_file
from dml_core.shards.errors import DataError, DataExistsError
from dml_core.shards.images import check_image
from dml_core.shards.manifest import (
    COLUMN_DOCS,
    FORMAT,
    MANIFEST_NAME,
    PARQUET_SCHEMA,
    SCHEMA_VERSION,
    class_name_key,
    class_name_problem,
    nfc,
)
from dml_core.storage import LocalStorage, S3Storage, open_storage

__all__ = ["Record", "write_shards"]

# Per-column parquet compression: image bytes are compressed already (JPEG/PNG), the small columns are not.
_COMPRESSION = {
    "image": "NONE",
    "label": "ZSTD",
    "class_name": "ZSTD",
    "split": "ZSTD",
    "relpath": "ZSTD",
    "sha256": "ZSTD",
    "index": "ZSTD",
}


@dataclass(frozen=True)
class Record:
    """One image to write.  `read()` returns the encoded bytes; it is called once, while writing, so a
    prepare run never holds more than one row group of image bytes."""

    relpath: str
    label: int
    class_name: str
    split: str
    read: Callable[[], bytes]
    source: str | None = None  # where the bytes come from (a file, `<zip>: <member>`), named in errors


def write_shards(
    records: Iterable[Record],
    dest: str | os.PathLike,
    *,
    dataset: str,
    endpoint_url: str | None = None,
    max_shard_bytes: int = 128 << 20,
    row_group_rows: int = 64,
    info: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Write `records` as parquet shards plus `manifest.json` under `dest`; return the manifest.

    Rows are sorted by (label, relpath) first, so each class is contiguous and an m-per-class batch reads
    few row groups.  Every image is fully decoded first (`check_image`): a truncated or corrupt file fails here,
    naming `Record.source` (else its relpath), not later in a training worker.  A shard is closed once its image
    bytes reach `max_shard_bytes`.  The manifest goes last, so a crashed run leaves no manifest (and readers
    refuse the destination).
    """
    if row_group_rows < 1:
        raise ValueError(f"row_group_rows must be >= 1, got {row_group_rows}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    storage = open_storage(dest, endpoint_url=endpoint_url)
    if storage.exists(MANIFEST_NAME) and not overwrite:
        raise DataExistsError(
            f"{storage.uri_of(MANIFEST_NAME)}: exists; pass overwrite=True (--overwrite) to replace it"
        )
    rows = sorted(records, key=lambda r: (int(r.label), r.relpath))
    if not rows:
        raise DataError(f"{dest}: no images found to write for {dataset}")
    rows = _validate_records(rows, dataset)
    shards = _write_rows(
        rows,
        storage,
        dataset=dataset,
        row_group_rows=row_group_rows,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )
    manifest = _manifest(rows, shards, dataset, info)
    storage.put_bytes(json.dumps(manifest, indent=1).encode(), MANIFEST_NAME)
    return manifest


def _validate_records(rows: Sequence[Record], dataset: str) -> list[Record]:
    """One relpath per image, labels >= 0, class names valid (`class_name_problem`), and labels <-> class names
    one-to-one after NFC normalisation; two labels whose names differ only by case or normalisation are refused,
    naming both (anyone who goes by names would merge them).  Returns the rows with NFC class names."""
    seen: set[str] = set()
    names: dict[int, str] = {}
    keys: dict[str, tuple[int, str]] = {}
    out = []
    for r in rows:
        where = r.source or r.relpath
        if r.relpath in seen:
            raise DataError(f"{where}: {dataset}: duplicate image path {r.relpath!r}")
        seen.add(r.relpath)
        label = int(r.label)
        if label < 0:
            raise DataError(f"{where}: {dataset}: negative label {r.label}")
        problem = class_name_problem(r.class_name)
        if problem:
            raise DataError(f"{where}: {dataset}: label {label}: class name {r.class_name!r} {problem}")
        name = nfc(r.class_name)
        prev = names.setdefault(label, name)
        if prev != name:
            raise DataError(f"{where}: {dataset}: label {r.label} has two class names, {prev!r} and {r.class_name!r}")
        other_label, other_raw = keys.setdefault(class_name_key(name), (label, r.class_name))
        if other_label != label:
            if other_raw == r.class_name:
                raise DataError(
                    f"{where}: {dataset}: labels {other_label} and {r.label} have the same class name {r.class_name!r}"
                )
            raise DataError(
                f"{where}: {dataset}: class names {other_raw!r} (label {other_label}) and "
                f"{r.class_name!r} (label {label}) differ only by case or Unicode normalisation"
            )
        out.append(r if name == r.class_name else dataclasses.replace(r, class_name=name))
    return out


def _write_rows(
    rows: list[Record],
    storage: LocalStorage | S3Storage,
    *,
    dataset: str,
    row_group_rows: int,
    max_shard_bytes: int,
    progress: bool,
) -> list[dict]:
    """Every row into shards at the destination; returns the manifest entries of the shards.

    Shards are written to a staging folder and moved into place only once every image decoded, so a run that
    fails (a corrupt image, an interrupt) leaves nothing under the destination (local) or deletes what it uploaded
    (S3)."""
    # tqdm.auto probes for Jupyter (it imports asyncio): only prepare's progress bar needs it, not a reader
    from tqdm.auto import tqdm

    created = (
        [d for d in (storage.root, storage.root / "shards") if not d.exists()]
        if isinstance(storage, LocalStorage)
        else []
    )
    writer = _ShardWriter(storage, _staging_dir(storage), max_shard_bytes=max_shard_bytes)
    done = False
    try:
        group = _empty_group()
        for index, rec in enumerate(tqdm(rows, desc=f"prepare {dataset}", unit="img", disable=not progress)):
            _append_row(group, index, rec)
            if len(group["image"]) >= row_group_rows:
                writer.write_group(group)
        writer.write_group(group)
        writer.finish()
        done = True
    finally:
        writer.cleanup(done, created)
    return writer.shards


def _staging_dir(storage: LocalStorage | S3Storage) -> Path:
    """A fresh staging folder with a `shards/` sub-folder: beside the destination's shards (local, so that moving
    a shard into place is a rename) or in the temp dir (S3, uploaded from there)."""
    if isinstance(storage, LocalStorage):
        staging = storage.root / "shards" / f".staging-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
    else:
        staging = Path(tempfile.mkdtemp(prefix="dmlrc-shards-"))
    (staging / "shards").mkdir(parents=True, exist_ok=True)
    return staging


def _empty_group() -> dict[str, list]:
    return {c: [] for c in PARQUET_SCHEMA.names}


def _append_row(group: dict[str, list], index: int, rec: Record) -> None:
    """Read one record's bytes, decode them fully (`check_image`) and add the row (global position `index`)."""
    data = rec.read()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{rec.relpath}: read() returned {type(data).__name__}, expected bytes")
    data = bytes(data)
    check_image(data, rec.source or rec.relpath)
    group["image"].append(data)
    group["label"].append(int(rec.label))
    group["class_name"].append(rec.class_name)
    group["split"].append(rec.split)
    group["relpath"].append(rec.relpath)
    group["sha256"].append(hashlib.sha256(data).hexdigest())
    group["index"].append(index)


class _ShardWriter:
    """Row groups into numbered parquet shards in a staging folder.  A shard is closed once its image bytes reach
    `max_shard_bytes`; a closed shard waits in the staging folder (local: moved into place by `finish`) or is
    uploaded at once (S3)."""

    def __init__(self, storage: LocalStorage | S3Storage, staging: Path, *, max_shard_bytes: int):
        self.storage = storage
        self.local = isinstance(storage, LocalStorage)
        self.staging = staging
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[dict] = []  # manifest entries of the closed shards
        self.uploaded: list[str] = []  # keys put to S3, deleted again if the run fails
        self.writer: pq.ParquetWriter | None = None  # the open shard, if any
        self.path = Path()  # its temp file
        self.name = ""  # its key under the destination
        self.rows = 0
        self.bytes = 0  # image bytes written to the open shard
        self.groups: list[int] = []  # its row-group sizes

    def _open(self) -> pq.ParquetWriter:
        self.name = f"shards/part-{len(self.shards):05d}.parquet"
        self.path = self.staging / "shards" / f".{Path(self.name).name}.{uuid.uuid4().hex}.tmp"
        self.writer = pq.ParquetWriter(
            self.path,
            PARQUET_SCHEMA,
            compression=_COMPRESSION,
            # min/max statistics of a binary image column would bloat the footer for nothing, and a
            # dictionary of unique image blobs only adds a decode step: both only for the small columns
            write_statistics=["label", "split"],
            use_dictionary=["label", "class_name", "split"],
        )
        self.rows, self.bytes, self.groups = 0, 0, []
        return self.writer

    def write_group(self, group: dict[str, list]) -> None:
        """Write `group` as one row group (nothing if empty) and empty it; close the shard once it is full."""
        n = len(group["image"])
        if n == 0:
            return
        writer = self.writer if self.writer is not None else self._open()
        writer.write_table(pa.table(group, schema=PARQUET_SCHEMA), row_group_size=n)
        self.rows += n
        self.groups.append(n)
        self.bytes += sum(len(b) for b in group["image"])
        for c in group:
            group[c] = []
        if self.bytes >= self.max_shard_bytes:
            self._close()

    def _close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        entry = {
            "path": self.name,
            "sha256": sha256_file(self.path),
            "rows": self.rows,
            "bytes": self.path.stat().st_size,
            "row_groups": self.groups,
        }
        if self.local:
            os.replace(self.path, self.staging / self.name)
        else:
            self.uploaded.append(self.name)
            self.storage.put_file(self.path, self.name)
            self.path.unlink()
        self.shards.append(entry)
        self.writer = None

    def finish(self) -> None:
        """Close the last shard; local: move every shard from the staging folder into place."""
        self._close()
        if isinstance(self.storage, LocalStorage):
            for entry in self.shards:
                os.replace(self.staging / entry["path"], self.storage.root / entry["path"])

    def cleanup(self, done: bool, created: list[Path]) -> None:
        """Drop a partial shard and the staging folder; after a failed run also the folders this run created (if
        nothing else was put there since) and, best effort, what it uploaded (the manifest is absent, so readers
        refuse those anyway)."""
        if self.writer is not None:  # failed mid-shard: drop the partial file
            self.writer.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        shutil.rmtree(self.staging, ignore_errors=True)
        if done:
            return
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        for key in self.uploaded:
            with contextlib.suppress(Exception):
                self.storage.delete(key)


def _manifest(rows: list[Record], shards: list[dict], dataset: str, info: dict | None) -> dict:
    """The manifest of the written rows: classes sorted by label with their counts, counts per original split."""
    labels = np.array([r.label for r in rows], dtype=np.int64)
    uniq, counts = np.unique(labels, return_counts=True)
    names = {int(r.label): r.class_name for r in rows}
    splits, split_counts = np.unique(np.array([r.split for r in rows]), return_counts=True)
    return {
        "schema_version": SCHEMA_VERSION,
        "format": FORMAT,
        "dataset": dataset,
        "num_images": len(rows),
        "num_classes": len(uniq),
        "classes": [{"label": int(l), "name": names[int(l)], "count": int(c)} for l, c in zip(uniq, counts)],
        "counts": {
            "images": len(rows),
            "classes": len(uniq),
            "per_split": {str(s): int(c) for s, c in zip(splits, split_counts)},
        },
        "shards": shards,
        "columns": COLUMN_DOCS,
        "info": dict(info or {}),
    }
