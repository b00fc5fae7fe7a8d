"""The format: the parquet schema, the manifest's fields and their validation, and the rules for class names."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import pyarrow as pa

from dml_core.shards.errors import ManifestError
from dml_core.storage import is_s3_uri, open_storage

__all__ = [
    "SCHEMA_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST_NAME",
    "FORMAT",
    "PARQUET_SCHEMA",
    "COLUMN_DOCS",
    "read_manifest",
    "validate_manifest",
    "split_manifest_uri",
    "class_name_problem",
    "class_name_key",
    "nfc",
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


# --------------------------------------------------------------------------------------------- class names


def class_name_problem(name: object) -> str | None:
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


# --------------------------------------------------------------------------------------------- the manifest


def split_manifest_uri(uri: str | os.PathLike) -> tuple[str, str]:
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
    root, name = split_manifest_uri(uri)
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
    return validate_manifest(m, where)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expect(cond: bool, where: str, field: str, want: str, value: object) -> None:
    if not cond:
        shown = repr(value)
        raise ManifestError(
            f"{where}: {field}: expected {want}, got {shown[:80]}"
            f"{'...' if len(shown) > 80 else ''} ({type(value).__name__})"
        )


def validate_manifest(m: Any, where: str) -> dict:
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
    _check_class_fields(m["classes"], where)
    _check_shard_fields(m["shards"], where)
    total = sum(sh["rows"] for sh in m["shards"])
    if total != m["num_images"]:
        raise ManifestError(f"{where}: num_images: {m['num_images']}, but the shards hold {total} rows")
    _check_class_list(m["classes"], where)
    if sum(c["count"] for c in m["classes"]) != m["num_images"]:
        raise ManifestError(
            f"{where}: classes: counts sum to {sum(c['count'] for c in m['classes'])}, num_images = {m['num_images']}"
        )
    return m


def _check_class_fields(classes: Any, where: str) -> None:
    """`classes`: a list of objects with `label` (int >= 0), `name` (str) and `count` (int >= 1)."""
    _expect(isinstance(classes, list), where, "classes", "a list", classes)
    for i, c in enumerate(classes):
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


def _check_shard_fields(shards: Any, where: str) -> None:
    """`shards`: a list of objects with a relative `path`, a `sha256`, `rows` and `row_groups` summing to `rows`."""
    _expect(isinstance(shards, list), where, "shards", "a list", shards)
    for i, sh in enumerate(shards):
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


def _check_class_list(classes: list[dict], where: str) -> None:
    """Labels and names unique, every name valid, no two names that differ only by case or normalisation."""
    labels = [c["label"] for c in classes]
    if len(set(labels)) != len(labels):
        raise ManifestError(f"{where}: classes: a label is listed twice")
    names = [c["name"] for c in classes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise ManifestError(f"{where}: classes: two classes have the same name {dup}")
    first: dict[str, int] = {}
    for i, c in enumerate(classes):
        problem = class_name_problem(c["name"])
        if problem:
            raise ManifestError(f"{where}: classes[{i}].name: class name {c['name']!r} {problem}")
        j = first.setdefault(class_name_key(c["name"]), i)
        if j != i:
            raise ManifestError(
                f"{where}: classes[{j}].name {classes[j]['name']!r} and classes[{i}].name "
                f"{c['name']!r} differ only by case or Unicode normalisation"
            )
