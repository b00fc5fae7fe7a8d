"""Parquet image shards: the on-disk / on-S3 format `dmlrc data prepare` writes and training reads.

Layout under a destination (local directory or `s3://bucket/prefix`, see `dml_core.storage`)::

    manifest.json                 # written last: a destination with a manifest is complete
    shards/part-00000.parquet     # rows sorted by (label, relpath), so an m-per-class batch touches few row groups
    shards/part-00001.parquet
    ...

Parquet columns (`PARQUET_SCHEMA`): `image` (encoded JPEG/PNG bytes, stored uncompressed: they are compressed
already), `label` (int64), `class_name`, `split` (the dataset's *original* split: train/test, query/gallery, ...),
`relpath` (path inside the official layout), `sha256` (hex digest of `image`) and `index` (int64: the row's
global position in the dataset, 0..num_images-1; schema v2).

`manifest.json` (`SCHEMA_VERSION` = 2; v1, which has no `index` column, is still read)::

    {"schema_version": 2, "format": "dmlrc-image-shards", "dataset": "cub200",
     "num_images": 11788, "num_classes": 200,
     "classes": [{"label": 0, "name": "001.Black_footed_Albatross", "count": 60}, ...],   # sorted by label
     "counts": {"images": 11788, "classes": 200, "per_split": {"test": 5794, "train": 5994}},
     "shards": [{"path": "shards/part-00000.parquet", "sha256": "...", "rows": 2400, "bytes": 1.3e8,
                 "row_groups": [64, 64, ..., 32]}, ...],
     "columns": {...}, "info": {"label_convention": "...", ...}}

Reading (`ShardedTable`) keeps memory bounded: labels and original splits are read up front (two small
columns); image bytes are read one row group at a time on demand, through a small per-process LRU.  Each
shard is made local once: S3 shards are downloaded into a content-addressed cache dir (`<sha256>.parquet`) and
checked against the manifest's sha256 before use; local shards are read in place and hashed once (a stamp in the
cache dir remembers path, inode, size, mtime and ctime: restoring a file's mtime after editing it cannot restore its
ctime).  Opening an S3 table therefore downloads every shard once (the label column lives in the shards): disk use
is the dataset's size, memory is not.

Integrity: a shard's row-group layout must equal the manifest's `row_groups` (a reordered list would
otherwise map rows to other classes' images); every row read checks its own `index` column (the row it holds)
and its image's sha256, so no check can pass at a wrong offset; `verify_shards` always re-hashes every shard (the
stamp only speeds up reads); `write_shards` fully decodes every image (PNG chunk CRCs included) before storing it.
`check_rows` is the cheap preflight: every row's image header (format + dimensions) without decoding.

Labels and class names (data that lies consistently: a shard re-stamped after its labels were edited passes every
checksum): every shard's columns must have the schema's types (a label column of strings is refused), and every
row's (label, class_name) must be the manifest's, so labels and names map one to one within and across shards.
Opening a `ShardedTable` checks this (two small columns per shard), so `verify_shards`, `check_rows` and every
reader do; `check_label_names(table | uri | manifest)` runs it on demand.  The manifest's class list may not hold
two names that differ only by case or Unicode normalisation, nor control characters; `write_shards` refuses the
same, stores class names in NFC, and stages its shards so that a failed run leaves nothing at the destination.
Every error is a `DataError` (a ValueError) whose message starts with the file (and row) at fault.
A `ShardedTable` pickles without open files or clients, and notices a fork, so DataLoader workers reopen their
own handles.

The modules: `errors` (the `DataError` family), `manifest` (schema, manifest validation, class-name rules),
`images` (`check_image`), `writer` (`Record`, `write_shards`), `cache` (local copies, stamps, the download lock),
`table` (`ShardedTable`) and `verify` (`verify_shards`, `check_rows`, `check_label_names`).  Import from
`dml_core.shards`: the names below are its public surface.
"""

from __future__ import annotations

from dml_core.shards.cache import default_cache_dir
from dml_core.shards.errors import (
    CorruptImageError,
    DataError,
    DataExistsError,
    DataFileNotFoundError,
    LayoutError,
    ManifestError,
    ShardChecksumError,
)
from dml_core.shards.images import check_image
from dml_core.shards.manifest import (
    COLUMN_DOCS,
    FORMAT,
    MANIFEST_NAME,
    PARQUET_SCHEMA,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    class_name_key,
    class_name_problem,
    nfc,
    read_manifest,
)
from dml_core.shards.table import ShardedTable
from dml_core.shards.verify import check_label_names, check_rows, verify_shards
from dml_core.shards.writer import Record, write_shards

__all__ = [
    "SCHEMA_VERSION",
    "READABLE_VERSIONS",
    "FORMAT",
    "COLUMN_DOCS",
    "PARQUET_SCHEMA",
    "MANIFEST_NAME",
    "Record",
    "DataError",
    "DataFileNotFoundError",
    "DataExistsError",
    "ShardChecksumError",
    "CorruptImageError",
    "ManifestError",
    "LayoutError",
    "check_image",
    "write_shards",
    "read_manifest",
    "ShardedTable",
    "verify_shards",
    "check_rows",
    "check_label_names",
    "class_name_problem",
    "class_name_key",
    "nfc",
    "default_cache_dir",
]
