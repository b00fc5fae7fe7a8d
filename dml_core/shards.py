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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import tempfile
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageFile, UnidentifiedImageError

from dml_core.storage import LocalStorage, is_s3_uri, open_storage

try:
    import fcntl  # POSIX only: elsewhere the shard download lock is a no-op
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None

__all__ = [
    "SCHEMA_VERSION",
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

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: no `index` column (rows are then checked by label)
MANIFEST_NAME = "manifest.json"
FORMAT = "dmlrc-image-shards"
PARQUET_SCHEMA = pa.schema(
    [
        ("image", pa.binary()),
        ("label", pa.int64()),
        ("class_name", pa.string()),
        ("split", pa.string()),
        ("relpath", pa.string()),
        ("sha256", pa.string()),
        ("index", pa.int64()),
    ]
)
COLUMN_DOCS = {
    "image": "encoded image bytes (JPEG/PNG), as in the official files",
    "label": "int64 class label (per-dataset convention in info.label_convention)",
    "class_name": "human-readable class name",
    "split": "the dataset's original split of this image (e.g. train/test, train/query/gallery)",
    "relpath": "path of the image inside the official layout",
    "sha256": "hex sha256 of the image bytes",
    "index": "int64 global row number (0..num_images-1): every read checks it holds the row it was asked for",
}


class DataError(ValueError):
    """Bad data given by a user (a dataset, a listing file, a shard, a manifest).  The message starts with the
    file at fault (and the row / line), so a CLI prints it as one line: `data error: <message>`."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A file the data needs is missing (also a FileNotFoundError)."""


class DataExistsError(DataError, FileExistsError):
    """A destination already holds a prepared dataset (also a FileExistsError)."""


class ShardChecksumError(DataError):
    """A shard file does not match the sha256 the manifest lists for it."""


class CorruptImageError(DataError):
    """An image's bytes do not match their sha256, or do not decode."""


class ManifestError(DataError):
    """A manifest is missing, malformed, of an unknown schema version, or inconsistent with its shards."""


class LayoutError(DataError):
    """An official-layout listing (images.txt, Ebay_*.txt, a zip ...) is malformed or points outside `--src`."""


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


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """`$DMLRC_CACHE_DIR`, else ~/.cache/dmlrc; shards go to its `shards/` sub-directory."""
    return Path(os.environ.get("DMLRC_CACHE_DIR") or Path.home() / ".cache" / "dmlrc").expanduser()


# --------------------------------------------------------------------------------------------- writing


def _image_header(data: bytes, where: str):
    """(format, width, height) from the header only (magic bytes + dimensions); CorruptImageError if unreadable."""
    if not data:
        raise CorruptImageError(f"{where}: empty image")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise CorruptImageError(f"{where}: not a readable image ({e})") from e
    if w < 1 or h < 1:
        raise CorruptImageError(f"{where}: {fmt} image of size {w}x{h}")
    return fmt, w, h


_IEND_CRC = bytes.fromhex("ae426082")  # crc32(b"IEND"), the same in every PNG


def check_image(data: bytes, where: str) -> tuple[str, int, int]:
    """Fully check one encoded image: the header, then every PNG chunk's CRC (`Image.verify`), then a complete
    decode (a truncated file fails: Pillow refuses truncated images unless ImageFile.LOAD_TRUNCATED_IMAGES is
    set, which this refuses to run under).  Returns (format, width, height).

    JPEG has no checksum: a flipped bit inside the entropy-coded data usually decodes to slightly different
    pixels and cannot be detected by any decoder; flipped markers, headers and truncation are caught."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: truncated images would pass as valid")
    fmt, w, h = _image_header(data, where)
    if fmt == "PNG":
        # Pillow stops at the IEND chunk without checking it: a cut or flipped IEND would pass
        end = data.rfind(b"IEND")
        if end < 4 or data[end - 4 : end] != b"\0\0\0\0" or data[end + 4 : end + 8] != _IEND_CRC:
            raise CorruptImageError(
                f"{where}: does not decode (PNG without an intact IEND chunk: truncated or damaged)"
            )
    try:
        if fmt == "PNG":
            with Image.open(io.BytesIO(data)) as im:
                im.verify()  # reads every chunk up to IEND and checks its CRC
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, zlib.error ... for bad data
        raise CorruptImageError(f"{where}: does not decode ({type(e).__name__}: {e})") from e
    return fmt, w, h


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
    # tqdm.auto probes for Jupyter (it imports asyncio): only prepare's progress bar needs it, not a reader
    from tqdm.auto import tqdm

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

    # Shards are written to a staging folder and moved into place only once every image decoded, so a run that
    # fails (a corrupt image, an interrupt) leaves nothing under `dest` (local) or deletes what it uploaded (S3).
    local = isinstance(storage, LocalStorage)
    created = [d for d in (storage.root, storage.root / "shards") if not d.exists()] if local else []
    if local:
        staging = storage.root / "shards" / f".staging-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
    else:
        staging = Path(tempfile.mkdtemp(prefix="dmlrc-shards-"))
    (staging / "shards").mkdir(parents=True, exist_ok=True)

    shards: list[dict] = []
    uploaded: list[str] = []
    state = {"writer": None, "path": None, "rows": 0, "bytes": 0, "groups": []}

    def open_shard():
        name = f"shards/part-{len(shards):05d}.parquet"
        tmp = staging / "shards" / f".{Path(name).name}.{uuid.uuid4().hex}.tmp"
        state.update(
            writer=pq.ParquetWriter(
                tmp,
                PARQUET_SCHEMA,
                compression={
                    "image": "NONE",
                    "label": "ZSTD",
                    "class_name": "ZSTD",
                    "split": "ZSTD",
                    "relpath": "ZSTD",
                    "sha256": "ZSTD",
                    "index": "ZSTD",
                },
                # min/max statistics of a binary image column would bloat the footer for nothing, and a
                # dictionary of unique image blobs only adds a decode step: both only for the small columns
                write_statistics=["label", "split"],
                use_dictionary=["label", "class_name", "split"],
            ),
            path=tmp,
            name=name,
            rows=0,
            bytes=0,
            groups=[],
        )

    def close_shard():
        state["writer"].close()
        tmp: Path = state["path"]
        digest = _sha256_file(tmp)
        entry = {
            "path": state["name"],
            "sha256": digest,
            "rows": state["rows"],
            "bytes": tmp.stat().st_size,
            "row_groups": state["groups"],
        }
        if local:
            os.replace(tmp, staging / state["name"])
        else:
            uploaded.append(state["name"])
            storage.put_file(tmp, state["name"])
            tmp.unlink()
        shards.append(entry)
        state["writer"] = None

    group: dict[str, list] = {c: [] for c in PARQUET_SCHEMA.names}

    def flush_group():
        n = len(group["image"])
        if n == 0:
            return
        if state["writer"] is None:
            open_shard()
        state["writer"].write_table(pa.table(group, schema=PARQUET_SCHEMA), row_group_size=n)
        state["rows"] += n
        state["groups"].append(n)
        state["bytes"] += sum(len(b) for b in group["image"])
        for c in group:
            group[c] = []
        if state["bytes"] >= max_shard_bytes:
            close_shard()

    done = False
    try:
        for index, rec in enumerate(tqdm(rows, desc=f"prepare {dataset}", unit="img", disable=not progress)):
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
            if len(group["image"]) >= row_group_rows:
                flush_group()
        flush_group()
        if state["writer"] is not None:
            close_shard()
        if local:
            for entry in shards:
                os.replace(staging / entry["path"], storage.root / entry["path"])
        done = True
    finally:
        if state["writer"] is not None:  # failed mid-shard: drop the partial file
            state["writer"].close()
            with contextlib.suppress(FileNotFoundError):
                Path(state["path"]).unlink()
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            for d in reversed(created):  # folders this run created, if nothing else was put there since
                with contextlib.suppress(OSError):
                    d.rmdir()
            for key in uploaded:  # best effort: the manifest is absent, so readers refuse these anyway
                with contextlib.suppress(Exception):
                    storage.delete(key)

    labels = np.array([r.label for r in rows], dtype=np.int64)
    uniq, counts = np.unique(labels, return_counts=True)
    names = {int(r.label): r.class_name for r in rows}
    splits, split_counts = np.unique(np.array([r.split for r in rows]), return_counts=True)
    manifest = {
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
    storage.put_bytes(json.dumps(manifest, indent=1).encode(), MANIFEST_NAME)
    return manifest


def class_name_problem(name) -> str | None:
    """Why `name` cannot be a class name, or None; the text follows the name (`f"class name {name!r} {problem}"`).
    A name must be a non-empty string without control characters: a newline would split every one-line report
    and log that prints it (U+2028 / U+2029 are line breaks too)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp"):
            return f"contains the control character U+{ord(ch):04X}"
    return None


def class_name_key(name: str) -> str:
    """Two class names with the same key differ only by case or by Unicode normalisation (NFC vs NFD): on a
    case-insensitive file system, in a spreadsheet or to a reader they are one class."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", name).casefold())


def nfc(name: str) -> str:
    """The NFC form `prepare` stores class names in (macOS folders are NFD: 'café' would otherwise be stored in two
    byte sequences depending on where the dataset was unpacked)."""
    return unicodedata.normalize("NFC", name)


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


# --------------------------------------------------------------------------------------------- reading


def _split_manifest_uri(uri: str | os.PathLike) -> tuple[str, str]:
    """A manifest URI is the manifest file itself or the directory / prefix holding `manifest.json`."""
    s = str(uri)
    if s.endswith(".json"):
        if is_s3_uri(s):
            root, _, name = s.rpartition("/")
            return root, name
        p = Path(s)
        return str(p.parent), p.name
    return s.rstrip("/") if is_s3_uri(s) else s, MANIFEST_NAME


def read_manifest(uri: str | os.PathLike, endpoint_url: str | None = None) -> dict:
    """Load and validate a manifest (local path/dir or s3:// URI); ManifestError names the file and the field."""
    root, name = _split_manifest_uri(uri)
    storage = open_storage(root, endpoint_url=endpoint_url)
    where = storage.uri_of(name)
    try:
        raw = storage.get_bytes(name)
    except FileNotFoundError as e:
        raise ManifestError(f"{where}: no manifest here (was `dmlrc data prepare` run to completion?)") from e
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e})") from None
    return _validate_manifest(m, where)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expect(cond: bool, where: str, field: str, want: str, value) -> None:
    if not cond:
        shown = repr(value)
        raise ManifestError(
            f"{where}: {field}: expected {want}, got {shown[:80]}"
            f"{'...' if len(shown) > 80 else ''} ({type(value).__name__})"
        )


def _validate_manifest(m, where: str) -> dict:
    """Types and internal consistency of a manifest; fields are named as `shards[0].row_groups[2]`."""
    if not isinstance(m, dict):
        raise ManifestError(f"{where}: not a JSON object (the top level is a {type(m).__name__})")
    version = m.get("schema_version")
    if version not in READABLE_VERSIONS or not _is_int(version):
        raise ManifestError(
            f"{where}: schema_version {version!r} is not supported (this code reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    for key in ("dataset", "num_images", "classes", "shards"):
        if key not in m:
            raise ManifestError(f"{where}: {key}: missing field")
    _expect(isinstance(m["dataset"], str) and m["dataset"] != "", where, "dataset", "a non-empty string", m["dataset"])
    _expect(_is_int(m["num_images"]) and m["num_images"] >= 0, where, "num_images", "an integer >= 0", m["num_images"])
    _expect(isinstance(m["classes"], list), where, "classes", "a list", m["classes"])
    for i, c in enumerate(m["classes"]):
        f = f"classes[{i}]"
        _expect(isinstance(c, dict), where, f, "an object", c)
        for key, ok, want in (
            ("label", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
            ("name", lambda v: isinstance(v, str), "a string"),
            ("count", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        ):
            if key not in c:
                raise ManifestError(f"{where}: {f}.{key}: missing field")
            _expect(ok(c[key]), where, f"{f}.{key}", want, c[key])
    _expect(isinstance(m["shards"], list), where, "shards", "a list", m["shards"])
    for i, sh in enumerate(m["shards"]):
        f = f"shards[{i}]"
        _expect(isinstance(sh, dict), where, f, "an object", sh)
        for key in ("path", "sha256", "rows", "row_groups"):
            if key not in sh:
                raise ManifestError(f"{where}: {f}.{key}: missing field")
        path = sh["path"]
        _expect(
            isinstance(path, str)
            and path != ""
            and not path.startswith("/")
            and ".." not in path.split("/")
            and "\\" not in path,
            where,
            f"{f}.path",
            "a relative '/'-separated path without '..'",
            path,
        )
        digest = sh["sha256"]
        _expect(
            isinstance(digest, str) and len(digest) == 64 and all(ch in "0123456789abcdef" for ch in digest),
            where,
            f"{f}.sha256",
            "64 lower-case hex digits",
            digest,
        )
        _expect(_is_int(sh["rows"]) and sh["rows"] >= 0, where, f"{f}.rows", "an integer >= 0", sh["rows"])
        groups = sh["row_groups"]
        _expect(isinstance(groups, list), where, f"{f}.row_groups", "a list of integers >= 1", groups)
        for j, n in enumerate(groups):
            _expect(_is_int(n) and n >= 1, where, f"{f}.row_groups[{j}]", "an integer >= 1", n)
        if sum(groups) != sh["rows"]:
            raise ManifestError(f"{where}: {f}.row_groups: sum to {sum(groups)}, {f}.rows = {sh['rows']} ({path})")
    total = sum(sh["rows"] for sh in m["shards"])
    if total != m["num_images"]:
        raise ManifestError(f"{where}: num_images: {m['num_images']}, but the shards hold {total} rows")
    labels = [c["label"] for c in m["classes"]]
    if len(set(labels)) != len(labels):
        raise ManifestError(f"{where}: classes: a label is listed twice")
    names = [c["name"] for c in m["classes"]]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ManifestError(f"{where}: classes: two classes have the same name {dup}")
    first: dict[str, int] = {}
    for i, c in enumerate(m["classes"]):
        problem = class_name_problem(c["name"])
        if problem:
            raise ManifestError(f"{where}: classes[{i}].name: class name {c['name']!r} {problem}")
        j = first.setdefault(class_name_key(c["name"]), i)
        if j != i:
            raise ManifestError(
                f"{where}: classes[{j}].name {m['classes'][j]['name']!r} and classes[{i}].name "
                f"{c['name']!r} differ only by case or Unicode normalisation"
            )
    if sum(c["count"] for c in m["classes"]) != m["num_images"]:
        raise ManifestError(
            f"{where}: classes: counts sum to {sum(c['count'] for c in m['classes'])}, num_images = {m['num_images']}"
        )
    return m


class _ShardSource:
    """Everything shared by a table and its subsets: the manifest, the storage, and per-process handles."""

    def __init__(self, uri, *, endpoint_url=None, cache_dir=None, cache_row_groups=16, verify_rows=True, rehash=False):
        root, name = _split_manifest_uri(uri)
        self.storage = open_storage(root, endpoint_url=endpoint_url)
        self.manifest_uri = self.storage.uri_of(name)
        self.manifest = read_manifest(uri, endpoint_url=endpoint_url)
        # No cache_dir given: every process uses its own machine's default (a worker node on another machine has
        # its own disk and home; the driver's path may not exist there), also after unpickling.
        self.cache_dir_given = cache_dir is not None
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.cache_row_groups = int(cache_row_groups)
        self.verify_rows = bool(verify_rows)
        self.rehash = bool(rehash)  # verify: hash every shard even when a stamp / cached copy says it is known
        # v2 rows carry their global index; v1 rows are checked by label (weaker: a wrong row of the same class
        # passes, but never one of another class)
        self.id_column = "index" if self.manifest["schema_version"] >= 2 else "label"
        shards = self.manifest["shards"]
        self.shard_starts = np.cumsum([0] + [s["rows"] for s in shards])
        self.group_starts = [np.cumsum([0] + list(s["row_groups"])) for s in shards]
        self._reset_process_state()

    # Per-process state: never pickled, rebuilt after a fork (a forked worker must not share file offsets).
    def _reset_process_state(self):
        self._pid = os.getpid()
        self._files: dict[int, pq.ParquetFile] = {}
        self._local: dict[int, Path] = {}
        self._lru: OrderedDict[tuple[int, int], tuple[pa.Array, pa.Array, pa.Array, np.ndarray]] = OrderedDict()
        self.labels: np.ndarray | None = None  # the label column, set by ShardedTable (v1 row checks use it)

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_files", "_local", "_lru", "_pid"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not self.cache_dir_given:
            self.cache_dir = default_cache_dir()
        self._reset_process_state()

    def _check_process(self):
        if self._pid != os.getpid():
            self._reset_process_state()

    def shard_name(self, k: int) -> str:
        return self.manifest["shards"][k]["path"]

    def local_shard(self, k: int) -> Path:
        """Path of a verified local copy of shard k (downloaded into the cache for S3)."""
        self._check_process()
        if k in self._local:
            return self._local[k]
        entry = self.manifest["shards"][k]
        expected = entry["sha256"]
        in_place = self.storage.local_path(entry["path"])
        if in_place is not None:
            path = _verify_in_place(in_place, expected, self.cache_dir / "verified", entry["path"], rehash=self.rehash)
        else:
            path = _download_verified(
                self.storage, entry["path"], expected, self.cache_dir / "shards", rehash=self.rehash
            )
        self._local[k] = path
        return path

    def parquet(self, k: int) -> pq.ParquetFile:
        self._check_process()
        f = self._files.get(k)
        if f is None:
            path = self.local_shard(k)
            try:
                f = pq.ParquetFile(path, memory_map=True)
            except (pa.ArrowException, OSError) as e:
                raise ShardChecksumError(
                    f"{path}: shard {self.shard_name(k)} is not a readable parquet file ({e})"
                ) from e
            self._check_layout(k, f)
            self._files[k] = f
        return f

    def read_group(self, k: int, rg: int | None, columns: list[str]) -> pa.Table:
        """Row group `rg` of shard k (all of it if None); a page that does not decode is a CorruptImageError
        naming the shard (its sha256 matched, so the manifest was written for a damaged file)."""
        f = self.parquet(k)
        try:
            if rg is None:
                return f.read(columns=columns, use_threads=False)
            return f.read_row_group(rg, columns=columns, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            part = f"row group {rg}" if rg is not None else f"columns {columns}"
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} {part}: unreadable ({type(e).__name__}: {e})"
            ) from e

    def _check_layout(self, k: int, f: pq.ParquetFile) -> None:
        """The file's schema, rows and row-group sizes must be the manifest's: rows are located through the
        manifest's `row_groups`, so a reordered list would read other rows (of other classes)."""
        entry = self.manifest["shards"][k]
        where = f"{self.manifest_uri}: shards[{k}] ({entry['path']})"
        names = set(f.schema_arrow.names)
        need = set(PARQUET_SCHEMA.names) - ({"index"} if self.id_column == "label" else set())
        if not need <= names:
            raise ManifestError(f"{where}: the file lacks columns {sorted(need - names)}")
        for name in sorted(need):  # a label column of strings would otherwise be parsed back into numbers
            got, want = f.schema_arrow.field(name).type, PARQUET_SCHEMA.field(name).type
            if got != want:
                raise ManifestError(f"{where}: column {name!r} is {got}, expected {want}")
        meta = f.metadata
        if meta.num_rows != entry["rows"]:
            raise ManifestError(f"{where}: rows {entry['rows']}, but the file holds {meta.num_rows} rows")
        actual = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if actual != list(entry["row_groups"]):

            def shown(xs):
                return str(xs) if len(xs) <= 12 else f"{str(xs[:12])[:-1]}, ...] ({len(xs)} groups)"

            raise ManifestError(
                f"{where}: row_groups {shown(list(entry['row_groups']))} do not match the "
                f"file's row groups {shown(actual)}"
            )

    def locate(self, g: int) -> tuple[int, int, int, int]:
        """Global row -> (shard, row in shard, row group, offset in row group)."""
        k = int(np.searchsorted(self.shard_starts, g, side="right") - 1)
        r = g - int(self.shard_starts[k])
        starts = self.group_starts[k]
        rg = int(np.searchsorted(starts, r, side="right") - 1)
        return k, r, rg, r - int(starts[rg])

    def row_group(self, k: int, rg: int) -> tuple[pa.Array, pa.Array, pa.Array, np.ndarray]:
        self._check_process()
        key = (k, rg)
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            return hit
        # One thread: this runs inside a DataLoader worker, which is the unit of parallelism.
        t = self.read_group(k, rg, ["image", "sha256", "relpath", self.id_column])
        # Keep Arrow arrays (no per-row Python objects); a row is converted only when it is asked for.
        value = (
            t.column("image").combine_chunks(),
            t.column("sha256").combine_chunks(),
            t.column("relpath").combine_chunks(),
            t.column(self.id_column).to_numpy(),
        )
        self._lru[key] = value
        while len(self._lru) > max(1, self.cache_row_groups):
            self._lru.popitem(last=False)
        return value

    def image_bytes(self, g: int) -> bytes:
        k, r, rg, off = self.locate(g)
        images, digests, relpaths, ids = self.row_group(k, rg)
        self._check_row_id(g, k, r, ids[off], relpaths[off])
        data = images[off].as_py()
        if self.verify_rows and hashlib.sha256(data).hexdigest() != digests[off].as_py():
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} row {r} "
                f"({relpaths[off].as_py()}): image bytes do not match their sha256"
            )
        return data

    def _check_row_id(self, g: int, k: int, r: int, got, relpath) -> None:
        """The row read must be row g: its own `index` (v2), or at least its label (v1)."""
        if self.id_column == "index":
            if int(got) != g:
                raise CorruptImageError(
                    f"{self.manifest_uri}: shard {self.shard_name(k)} row {r}: the row read "
                    f"there ({relpath.as_py()}) holds row {int(got)} of the dataset, expected "
                    f"{g} (manifest and shard disagree)"
                )
        elif self.labels is not None and int(got) != int(self.labels[g]):
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} row {r} ({relpath.as_py()}): "
                f"label {int(got)}, expected {int(self.labels[g])} (manifest and shard disagree)"
            )

    def relpath(self, g: int) -> str:
        k, _, rg, off = self.locate(g)
        return self.row_group(k, rg)[2][off].as_py()

    def row_name(self, g: int) -> str:
        k, r, _, _ = self.locate(g)
        return f"shard {self.shard_name(k)} row {r} ({self.relpath(g)})"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock so that DataLoader workers on one host download a shard once (no-op without fcntl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_verified(storage, key: str, expected: str, cache: Path, *, rehash: bool = False) -> Path:
    """Content-addressed cache: `<cache>/<sha256>.parquet` is written only after its hash was checked.

    A cached copy is trusted on reads while its stamp (see `_stamp_ok`) matches; a copy changed since, or any
    copy under `rehash` (verify), is hashed again, and one that no longer matches is dropped and downloaded anew
    (the cache was damaged, not the dataset: the new download is hashed too)."""
    final = cache / f"{expected}.parquet"
    stamps = cache.parent / "verified"
    if final.is_file() and _stamp_ok(final, expected, stamps, rehash):
        return final
    with _file_lock(cache / f"{expected}.lock"):
        if final.is_file():  # another worker finished it while we waited, or a damaged copy
            if _stamp_ok(final, expected, stamps, False):
                return final
            final.unlink()
        tmp = cache / f".{expected}.{uuid.uuid4().hex}.tmp"
        try:
            storage.get_file(key, tmp)
            got = _sha256_file(tmp)
            if got != expected:
                raise ShardChecksumError(
                    f"{storage.uri_of(key)}: sha256 {got} does not match the manifest's {expected}"
                )
            os.replace(tmp, final)
            _write_stamp(final, expected, stamps)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return final


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}\n{st.st_dev}\n{st.st_ino}\n{st.st_size}\n{st.st_mtime_ns}\n{st.st_ctime_ns}\n"


def _write_stamp(path: Path, expected: str, stamps: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        stamps.mkdir(parents=True, exist_ok=True)
        tmp = stamps / f".{expected}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(_fingerprint(path))
        os.replace(tmp, stamps / f"{expected}.ok")


def _stamp_ok(path: Path, expected: str, stamps: Path, rehash: bool) -> bool:
    """True if `path` hashes to `expected`.  A stamp (sha256 -> path, device, inode, size, mtime, ctime) left by
    an earlier hash lets *reads* skip re-hashing an unchanged file: ctime is set by the kernel on every write
    and cannot be set back by `touch`/`utime`, so editing a file and restoring its mtime still invalidates the
    stamp.  `rehash` (verify) ignores the stamp: a verify always hashes."""
    if not rehash:
        with contextlib.suppress(OSError):
            if (stamps / f"{expected}.ok").read_text() == _fingerprint(path):
                return True
    if _sha256_file(path) != expected:
        return False
    _write_stamp(path, expected, stamps)
    return True


def _verify_in_place(path: Path, expected: str, stamps: Path, name: str, *, rehash: bool = False) -> Path:
    """A local shard is read in place once it hashed to the manifest's sha256 (stamped, see `_stamp_ok`)."""
    if not path.is_file():
        raise DataFileNotFoundError(f"{path}: shard {name} listed in the manifest is missing")
    if not _stamp_ok(path, expected, stamps, rehash):
        raise ShardChecksumError(
            f"{path}: shard {name} sha256 {_sha256_file(path)} does not match the manifest's {expected}"
        )
    return path


class _LazyImages(Sequence):
    """`table.images[i]` -> verified image bytes, read from its row group on demand."""

    def __init__(self, table: ShardedTable):
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._table._source.image_bytes(self._table._global(i))


class ShardedTable:
    """An `ImageTable`-like view over prepared shards (local or S3) that never holds the dataset's bytes.

    Same surface as `dml_core.data.ImageTable`: `labels` (int64, read up front from the label column),
    `class_names` (aligned with `np.unique(labels)`), `images` (lazy: `images[i]` -> encoded bytes),
    `meta["split"]` (original split per row), `subset(classes)`, `take(indices)`, `row_name(i)`, `len()`;
    plus `relpath(i)`, `manifest` and `dataset`.
    `ImageDataset(table, transform)` decodes and transforms in DataLoader workers.
    """

    def __init__(self, uri, *, endpoint_url=None, cache_dir=None, cache_row_groups=16, verify_rows=True, rehash=False):
        source = _ShardSource(
            uri,
            endpoint_url=endpoint_url,
            cache_dir=cache_dir,
            cache_row_groups=cache_row_groups,
            verify_rows=verify_rows,
            rehash=rehash,
        )
        labels, splits = [], []
        v2 = source.id_column == "index"
        for k in range(len(source.manifest["shards"])):
            t = source.read_group(k, None, ["label", "class_name", "split"] + (["index"] if v2 else []))
            _check_shard_names(source, k, t)
            labels.append(t.column("label").to_numpy())
            splits.append(np.asarray(t.column("split").to_pylist(), dtype=str))
            if v2:  # rows in their global order: the shard is the one the manifest lists at this position
                idx = t.column("index").to_numpy()
                start = int(source.shard_starts[k])
                bad = np.flatnonzero(idx != np.arange(start, start + len(idx)))
                if bad.size:
                    r = int(bad[0])
                    raise ManifestError(
                        f"{source.manifest_uri}: shards[{k}] ({source.shard_name(k)}): row {r} "
                        f"holds row {int(idx[r])} of the dataset, expected {start + r} (shards "
                        "reordered or from another dataset)"
                    )
        all_labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
        _check_label_counts(all_labels, source.manifest, source.manifest_uri)
        source.labels = all_labels
        self._init_view(
            source, np.arange(len(all_labels)), all_labels, np.concatenate(splits) if splits else np.zeros(0, dtype=str)
        )

    def _init_view(self, source, rows, all_labels, all_splits):
        self._source = source
        self._rows = np.asarray(rows, dtype=np.int64)
        self._all_labels = all_labels
        self._all_splits = all_splits
        self.labels = all_labels[self._rows]
        self.meta = {"split": all_splits[self._rows]}
        names = {c["label"]: c["name"] for c in source.manifest["classes"]}
        self.class_names = [names[int(l)] for l in np.unique(self.labels)]
        self.images = _LazyImages(self)

    def _view(self, rows) -> ShardedTable:
        t = ShardedTable.__new__(ShardedTable)
        t._init_view(self._source, rows, self._all_labels, self._all_splits)
        return t

    @property
    def manifest(self) -> dict:
        return self._source.manifest

    @property
    def dataset(self) -> str:
        return self._source.manifest["dataset"]

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"ShardedTable({self._source.manifest_uri!r}, rows={len(self)}, classes={len(self.class_names)})"

    def _global(self, i: int) -> int:
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a table of {n} rows")
        return int(self._rows[i])

    def subset(self, classes) -> ShardedTable:
        """Rows whose label is in `classes` (labels unchanged)."""
        return self._view(self._rows[np.isin(self.labels, np.asarray(list(classes), dtype=np.int64))])

    def take(self, indices) -> ShardedTable:
        """Rows `indices` of this table, in that order."""
        return self._view(self._rows[np.asarray(indices, dtype=np.int64)])

    def row_name(self, i: int) -> str:
        return f"{self._source.manifest_uri}: {self._source.row_name(self._global(i))}"

    def relpath(self, i: int) -> str:
        """Path of row i's image in the official layout (read with its row group)."""
        return self._source.relpath(self._global(i))


def _check_shard_names(src: _ShardSource, k: int, t: pa.Table) -> None:
    """Every row's (label, class_name) of shard k must be a class of the manifest: labels and class names map one
    to one within the shard and, as every shard is held to the same list, across shards.  A shard re-stamped after
    its labels were swapped, shifted or its class names exchanged fails here, naming its first such row."""
    want = {int(c["label"]): c["name"] for c in src.manifest["classes"]}
    labels, names = t.column("label"), t.column("class_name")
    pairs = pa.table({"label": labels, "class_name": names}).group_by(["label", "class_name"]).aggregate([])
    bad = [
        (int(l), n)
        for l, n in zip(pairs.column("label").to_pylist(), pairs.column("class_name").to_pylist())
        if want.get(int(l)) != n
    ]
    if not bad:
        return
    lab, nam = labels.to_numpy(), np.asarray(names.to_pylist(), dtype=object)
    r = min(int(np.flatnonzero((lab == l) & (nam == n))[0]) for l, n in bad)
    l, n = int(lab[r]), nam[r]
    if l not in want:
        problem = f"label {l} (class name {n!r}) is not a class of the manifest"
    else:
        problem = f"label {l} has class name {n!r} here, but the manifest's label {l} is {want[l]!r}"
    groups = src.group_starts[k]
    rg = int(np.searchsorted(groups, r, side="right") - 1)
    relpath = src.read_group(k, rg, ["relpath"]).column("relpath")[r - int(groups[rg])].as_py()
    raise ManifestError(
        f"{src.manifest_uri}: shard {src.shard_name(k)} row {r} ({relpath}): {problem} (labels "
        "and class names must match one to one)"
    )


def check_label_names(source, *, endpoint_url: str | None = None, cache_dir=None) -> dict:
    """Labels <-> class names one to one: the manifest's class list (no two names that differ only by case or
    Unicode normalisation, no control characters) and every row's (label, class_name) in every shard against it.

    `source`: an opened `ShardedTable` (re-reads the label and class_name columns of its verified local shards:
    two small columns, no image bytes), a manifest URI (opening it runs the same check), or a manifest dict (its
    class list only).  Opening a `ShardedTable` runs this check already; this function is for a caller that holds
    a table opened earlier, or only a URI (a sweep's preflight).  Raises `ManifestError` naming the file, shard,
    row, label and class; returns {"classes": C, "rows": N}."""
    if isinstance(source, dict):
        m = _validate_manifest(source, f"manifest of {source.get('dataset', '?')}")
        return {"classes": len(m["classes"]), "rows": int(m["num_images"])}
    table = (
        source
        if isinstance(source, ShardedTable)
        else ShardedTable(source, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=1)
    )
    src = table._source
    _validate_manifest(src.manifest, src.manifest_uri)
    for k in range(len(src.manifest["shards"])):
        _check_shard_names(src, k, src.read_group(k, None, ["label", "class_name"]))
    return {"classes": len(src.manifest["classes"]), "rows": int(src.manifest["num_images"])}


def _check_label_counts(labels: np.ndarray, manifest: dict, where: str) -> None:
    uniq, counts = np.unique(labels, return_counts=True)
    got = {int(l): int(c) for l, c in zip(uniq, counts)}
    want = {int(c["label"]): int(c["count"]) for c in manifest["classes"]}
    if got != want:
        diff = sorted(l for l in set(got) | set(want) if got.get(l) != want.get(l))[:10]
        raise ManifestError(f"{where}: label column disagrees with the manifest's class counts for labels {diff}")


def verify_shards(uri, *, endpoint_url=None, cache_dir=None, decode: bool = True, progress: bool = False) -> dict:
    """Hash every shard (always: cache stamps are not trusted here), check the row-group layout and column types,
    labels <-> class names one to one (`check_label_names`), every row's index and sha256 and (if `decode`) fully
    decode every image (`check_image`).

    Raises `ShardChecksumError` / `CorruptImageError` / `ManifestError` naming the file and row; returns a
    summary dict.
    """
    # tqdm.auto probes for Jupyter (it imports asyncio): only verify's progress bar needs it, not a reader
    from tqdm.auto import tqdm

    table = ShardedTable(uri, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=2, rehash=True)
    src = table._source
    for g in tqdm(range(len(table)), desc="verify", unit="img", disable=not progress):
        data = src.image_bytes(g)
        if decode:
            check_image(data, f"{src.manifest_uri}: {src.row_name(g)}")
    return {
        "dataset": table.dataset,
        "images": len(table),
        "classes": len(table.class_names),
        "shards": len(src.manifest["shards"]),
    }


def check_rows(uri, *, endpoint_url=None, cache_dir=None, hash_rows: bool = False) -> dict:
    """The preflight's cheap check of a prepared dataset: the manifest, every shard's sha256 (stamped, as reads
    do), the row-group layout, labels <-> class names, every row's `index`, and every row's image *header* (magic
    bytes + dimensions, `PIL.Image.open` without decoding).  `hash_rows` also checks every image's sha256 (about
    the cost of reading the bytes once more).  Full decoding is `verify_shards`' job (and `write_shards` decoded
    every image).

    Raises a `DataError` whose message starts with the manifest and names the shard and row; returns
    {"dataset", "rows", "shards", "formats": {format: count}, "min_size": (w, h), "max_size": (w, h)}.
    """
    table = ShardedTable(uri, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=1)
    src = table._source
    formats: dict[str, int] = {}
    lo, hi = [np.inf, np.inf], [0, 0]
    for k, entry in enumerate(src.manifest["shards"]):
        for rg in range(len(entry["row_groups"])):
            t = src.read_group(k, rg, ["image", "sha256", "relpath", src.id_column])
            images, digests, relpaths = (t.column(c).combine_chunks() for c in ("image", "sha256", "relpath"))
            ids = t.column(src.id_column).to_numpy()
            base = int(src.shard_starts[k] + src.group_starts[k][rg])
            for off in range(len(images)):
                g = base + off
                src._check_row_id(g, k, g - int(src.shard_starts[k]), ids[off], relpaths[off])
                data = images[off].as_py()
                where = (
                    f"{src.manifest_uri}: shard {entry['path']} row {g - int(src.shard_starts[k])} "
                    f"({relpaths[off].as_py()})"
                )
                if hash_rows and hashlib.sha256(data).hexdigest() != digests[off].as_py():
                    raise CorruptImageError(f"{where}: image bytes do not match their sha256")
                fmt, w, h = _image_header(data, where)
                formats[fmt] = formats.get(fmt, 0) + 1
                lo, hi = [min(lo[0], w), min(lo[1], h)], [max(hi[0], w), max(hi[1], h)]
    return {
        "dataset": table.dataset,
        "rows": len(table),
        "shards": len(src.manifest["shards"]),
        "formats": formats,
        "min_size": tuple(int(x) for x in lo) if len(table) else None,
        "max_size": tuple(hi) if len(table) else None,
    }
