"""CSV datasets: one row per image, `path,label` (+ optional `class_name`, `split`, `query`, `gallery`), the
layout open-metric-learning (OML) users already have.  The CSV and the images may be local or on S3.

    path,label,class_name,split,is_query,is_gallery
    birds/albatross/001.jpg,0,albatross,train,,
    birds/wren/017.jpg,1,wren,validation,True,True

Columns (names are matched exactly, after stripping spaces; other columns, such as OML's bounding boxes, are
ignored; a UTF-8 byte-order mark is skipped):

* `path` (required): the image, relative to the root: the `root` argument, by default the CSV's own folder
  (local or `s3://bucket/prefix`).  No absolute paths, no `..`, no backslashes; `./` and doubled `/` are
  normalised away.  Each image may be listed once.
* `label` (required): a non-negative integer, kept as given.  Strings are refused rather than mapped to ids:
  a mapping would depend on the set of names, so a typo would silently become a new class.
* `class_name` (optional): the label's name, one name per label and one label per name; stored in Unicode NFC.
  Names that differ only by case or by Unicode normalisation are refused, as are control characters.  Without
  the column a class is named by its label (`"7"`).
* `split` (optional): the dataset's own split of the row (OML: `train` / `validation`); default `all`.
* `query` / `is_query`, `gallery` / `is_gallery` (optional): OML's retrieval flags (`True`/`False`/`1`/`0`/
  `yes`/`no`; empty or `None` = not set; not allowed on `train` rows).  A row that is a query only is stored with
  split `query`, a gallery-only row with `gallery` (as In-Shop's rows are); a row that is both (or neither)
  keeps its split.

Cells are stripped of surrounding spaces.  Every problem is a `DataError` naming the CSV and its row, counted
as a spreadsheet does: the header is row 1, the first image row 2.  Rows are returned sorted by (label, path),
the order `write_shards` stores them in, so the table read here and the prepared shards agree row for row.
"""

from __future__ import annotations

import csv as _csv
import io
import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

import numpy as np

from dml_core.datasets._sources import NO_SPLIT, LocalRoot, S3Root, open_root
from dml_core.shards import (
    DataError,
    DataFileNotFoundError,
    LayoutError,
    Record,
    class_name_key,
    class_name_problem,
    nfc,
)
from dml_core.storage import S3Storage, is_s3_uri

__all__ = ["CsvRow", "CsvDataset", "read_csv_rows", "records", "read_csv_dataset", "LABEL_CONVENTION"]

NAME = "csv"
LABEL_CONVENTION = "label = the CSV's label column (non-negative integers, as given)"
REQUIRED = ("path", "label")
COLUMNS = {
    "path": "path",
    "label": "label",
    "class_name": "class_name",
    "split": "split",
    "query": "query",
    "is_query": "query",
    "gallery": "gallery",
    "is_gallery": "gallery",
}
_INT = re.compile(r"[0-9]+")
_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}
_UNSET = {"", "none", "nan", "null"}
_MAX_LABEL = 2**63 - 1


@dataclass(frozen=True)
class CsvRow:
    row: int  # row number in the file (header = 1)
    relpath: str  # normalised, '/'-separated, relative to the root
    label: int
    class_name: str  # NFC
    split: str


@dataclass(frozen=True)
class CsvDataset:
    csv: str  # the CSV, as named in errors
    root: LocalRoot | S3Root
    rows: list[CsvRow]  # sorted by (label, relpath)


def _read_text(csv_uri: str, endpoint_url: str | None) -> str:
    if is_s3_uri(csv_uri):
        parent, _, name = csv_uri.rpartition("/")
        if not name or parent in ("s3:", "s3:/"):
            raise DataError(f"{csv_uri}: not the URI of a CSV file (s3://bucket/path/file.csv)")
        try:
            raw = S3Storage(parent, endpoint_url=endpoint_url).get_bytes(name)
        except FileNotFoundError:
            raise DataFileNotFoundError(f"{csv_uri}: no such CSV file") from None
    else:
        if not os.path.isfile(csv_uri):
            raise DataFileNotFoundError(f"{csv_uri}: no such CSV file")
        with open(csv_uri, "rb") as f:
            raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        bad = raw[e.start : e.start + 1]
        raise DataError(f"{csv_uri}: row {line}: not UTF-8 text (byte {e.start}: {bad!r})") from None


def _default_root(csv_uri: str) -> str:
    if is_s3_uri(csv_uri):
        return csv_uri.rpartition("/")[0]
    return os.path.dirname(os.path.abspath(csv_uri))


def _relpath(value: str, where: str, root) -> str:
    if not value:
        raise LayoutError(f"{where}: empty path")
    if "\\" in value:
        raise LayoutError(f"{where}: image path {value!r} contains a backslash (paths are '/'-separated)")
    pp = PurePosixPath(value)
    if pp.is_absolute() or PureWindowsPath(value).drive:
        raise LayoutError(f"{where}: image path {value!r} is absolute (paths must be relative to the root {root})")
    if ".." in pp.parts:
        raise LayoutError(f"{where}: image path {value!r} contains '..' and leaves the root {root}")
    rel = str(pp)
    if rel in ("", "."):
        raise LayoutError(f"{where}: image path {value!r} names the root itself, not an image")
    return rel


def _flag(value: str, where: str, column: str) -> bool | None:
    v = value.lower()
    if v in _UNSET:
        return None
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise LayoutError(f"{where}: {column} {value!r} is not a boolean (True/False, 1/0, yes/no, or empty)")


def _header(fields: list[str], csv_uri: str) -> dict[str, int]:
    cols: dict[str, int] = {}
    names = [f.strip(" ") for f in fields]
    for i, name in enumerate(names):
        key = COLUMNS.get(name)
        if key is None:
            continue
        if key in cols:
            raise LayoutError(f"{csv_uri}: row 1: column {key!r} is given twice ({names[cols[key]]!r} and {name!r})")
        cols[key] = i
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        shown = ", ".join(repr(n) for n in names) or "nothing"
        raise LayoutError(
            f"{csv_uri}: row 1: missing column {missing[0]!r} (the header has {shown}; required: {', '.join(REQUIRED)})"
        )
    return cols


def read_csv_rows(
    csv_uri: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    endpoint_url: str | None = None,
    check_files: bool = True,
) -> CsvDataset:
    """Parse and validate a dataset CSV (every rule in the module docstring) and, if `check_files`, that every
    listed image exists under the root (and, locally, does not leave it through a symbolic link, nor is the same
    file as another row's).  Nothing is read from the images."""
    csv_uri = str(csv_uri)
    text = _read_text(csv_uri, endpoint_url)
    root_obj = open_root(str(root) if root is not None else _default_root(csv_uri), endpoint_url)
    reader = _csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        first = next(reader, None)
        if first is None:
            raise LayoutError(f"{csv_uri}: empty file (expected a header row: path,label[,class_name,split,...])")
        cols = _header(first, csv_uri)
        rows: list[CsvRow] = []
        paths: dict[str, int] = {}
        label_name: dict[int, tuple[str, int]] = {}
        name_label: dict[str, tuple[int, str, int]] = {}
        while True:
            start = reader.line_num + 1
            fields = next(reader, None)
            if fields is None:
                break
            if not fields:
                continue  # a blank line
            rows.append(_row(fields, start, cols, len(first), csv_uri, root_obj, paths, label_name, name_label))
    except _csv.Error as e:
        raise LayoutError(f"{csv_uri}: row {reader.line_num}: not valid CSV ({e})") from None
    if not rows:
        raise LayoutError(f"{csv_uri}: has a header but no image rows")
    if check_files:
        _check_files(csv_uri, root_obj, rows)
    rows.sort(key=lambda r: (r.label, r.relpath))
    return CsvDataset(csv_uri, root_obj, rows)


def _row(fields, n, cols, width, csv_uri, root, paths, label_name, name_label) -> CsvRow:
    where = f"{csv_uri}: row {n}"
    if len(fields) != width:
        raise LayoutError(f"{where}: expected {width} fields (as the header), got {len(fields)}")
    cell = {k: fields[i].strip(" ") for k, i in cols.items()}
    rel = _relpath(cell["path"], where, root)
    if rel in paths:
        raise LayoutError(f"{where}: image {rel!r} is listed twice (first on row {paths[rel]})")
    paths[rel] = n
    if not _INT.fullmatch(cell["label"]) or len(cell["label"]) > 19 or int(cell["label"]) > _MAX_LABEL:
        raise LayoutError(f"{where}: label {cell['label']!r} is not a non-negative integer")
    label = int(cell["label"])
    if "class_name" in cols:
        raw = cell["class_name"]
        problem = class_name_problem(raw)
        if problem:
            raise LayoutError(f"{where}: class name {raw!r} {problem}")
    else:
        raw = str(label)
    name = nfc(raw)
    prev, prev_row = label_name.setdefault(label, (name, n))
    if prev != name:
        raise LayoutError(f"{where}: label {label} has class name {raw!r}, but row {prev_row} names it {prev!r}")
    other_label, other_raw, other_row = name_label.setdefault(class_name_key(name), (label, raw, n))
    if other_label != label:
        if other_raw == raw:
            raise LayoutError(
                f"{where}: class name {raw!r} has label {label}, but row {other_row} gives it label {other_label}"
            )
        raise LayoutError(
            f"{where}: class names {other_raw!r} (label {other_label}, row {other_row}) and {raw!r} "
            f"(label {label}) differ only by case or Unicode normalisation"
        )
    split = NO_SPLIT
    if "split" in cols:
        split = cell["split"]
        if not split:
            raise LayoutError(f"{where}: empty split")
        if any(not ch.isprintable() for ch in split):
            raise LayoutError(f"{where}: split {split!r} contains a control character")
    query = _flag(cell["query"], where, "query") if "query" in cols else None
    gallery = _flag(cell["gallery"], where, "gallery") if "gallery" in cols else None
    if (query or gallery) and split == "train":
        raise LayoutError(f"{where}: a train row cannot be a query or gallery image")
    if query and not gallery:
        split = "query"
    elif gallery and not query:
        split = "gallery"
    return CsvRow(n, rel, label, name, split)


def _check_files(csv_uri: str, root, rows: list[CsvRow]) -> None:
    """Every image exists (an S3 root is listed once); locally, links stay inside the root and no two rows are
    one file.  The first bad row (in file order) is named, with how many others share its problem."""
    missing = [r for r in rows if root.problem(r.relpath)]
    if missing:
        r = missing[0]
        more = f" ({len(missing)} of {len(rows)} listed images cannot be used)" if len(missing) > 1 else ""
        raise DataFileNotFoundError(f"{csv_uri}: row {r.row}: image {r.relpath!r} {root.problem(r.relpath)}{more}")
    if not root.remote:
        seen: dict[str, CsvRow] = {}
        for r in rows:
            other = seen.setdefault(root.real(r.relpath), r)
            if other is not r:
                raise LayoutError(
                    f"{csv_uri}: row {r.row}: image {r.relpath!r} is the same file as row {other.row}'s "
                    f"{other.relpath!r} (through a symbolic link)"
                )


def records(
    csv_uri: str | os.PathLike, *, root: str | os.PathLike | None = None, endpoint_url: str | None = None
) -> list[Record]:
    """One `Record` per row, for `write_shards` (`dmlrc data prepare csv`)."""
    ds = read_csv_rows(csv_uri, root=root, endpoint_url=endpoint_url)
    return [
        Record(
            relpath=r.relpath,
            label=r.label,
            class_name=r.class_name,
            split=r.split,
            read=ds.root.reader(r.relpath),
            source=ds.root.source(r.relpath),
        )
        for r in ds.rows
    ]


def read_csv_dataset(
    csv_uri: str | os.PathLike, *, root: str | os.PathLike | None = None, endpoint_url: str | None = None
):
    """A dataset CSV as an `ImageTable`: labels int64 as given, `class_names` aligned with the sorted labels,
    meta `split` and `relpath`; rows are file paths (local root) or image bytes (S3 root: read now, so prepare
    shards for anything large), sorted by (label, relpath)."""
    # torch: only reading into an ImageTable needs it; prepare's records() (`dmlrc data`) does not
    from dml_core.data import ImageTable

    ds = read_csv_rows(csv_uri, root=root, endpoint_url=endpoint_url)
    names = {r.label: r.class_name for r in ds.rows}
    labels = np.array([r.label for r in ds.rows], dtype=np.int64)
    rels = [r.relpath for r in ds.rows]
    images = [ds.root.reader(rel)() for rel in rels] if ds.root.remote else [ds.root.source(rel) for rel in rels]
    return ImageTable(
        images=images,
        labels=labels,
        class_names=[names[int(l)] for l in np.unique(labels)],
        meta={"relpath": np.array(rels, dtype=str), "split": np.array([r.split for r in ds.rows])},
    )
