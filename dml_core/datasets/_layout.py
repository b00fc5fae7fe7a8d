"""Helpers shared by the official-layout readers: find files, parse whitespace tables, keep every listed image
inside `--src`, with errors that start with the file (and line) at fault (`LayoutError`, a `DataError`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from dml_core.datasets._sources import read_local_file
from dml_core.shards import DataFileNotFoundError, LayoutError, Record


def find_file(src: Path, candidates: list[str], dataset: str) -> Path:
    """The first existing `src / c`; else DataFileNotFoundError listing where we looked."""
    for c in candidates:
        p = src / c
        if p.is_file():
            return p
    raise DataFileNotFoundError(
        f"{src / candidates[0]}: {dataset}: none of {[str(src / c) for c in candidates]} "
        f"exists (is --src the dataset's official directory?)"
    )


def read_rows(path: Path, n_fields: int, *, skip: int = 0, dataset: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-empty line after `skip` lines; every line must have `n_fields` fields."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if lineno <= skip or not line.strip():
                    continue
                fields = line.split()
                if len(fields) != n_fields:
                    raise LayoutError(
                        f"{path} line {lineno}: {dataset}: expected {n_fields} fields, got "
                        f"{len(fields)}: {line.rstrip()!r}"
                    )
                rows.append((lineno, fields))
    except UnicodeDecodeError as e:
        raise LayoutError(f"{path}: {dataset}: not UTF-8 text ({e})") from None
    if not rows:
        raise LayoutError(f"{path}: {dataset}: has no rows")
    return rows


def to_int(value: str, path: Path, lineno: int, field: str, dataset: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LayoutError(f"{path} line {lineno}: {dataset}: {field} {value!r} is not an integer") from None


def check_relpath(relpath: str, where: str) -> str:
    """A listed image path must be relative and stay below its root: no absolute path, drive, '..' or empty
    component (`where` = `<listing file> line N`).  Returns it unchanged."""
    pp = PurePosixPath(relpath)
    if not relpath or pp.is_absolute() or PureWindowsPath(relpath).drive or relpath.startswith("\\"):
        raise LayoutError(f"{where}: image path {relpath!r} is absolute (paths must be relative to --src)")
    if ".." in pp.parts or ".." in PureWindowsPath(relpath).parts:
        raise LayoutError(f"{where}: image path {relpath!r} contains '..' and leaves --src")
    return relpath


def file_record(root: Path, relpath: str, label: int, class_name: str, split: str, where: str | None = None) -> Record:
    """A record read from `root / relpath`, after the lexical containment check (`check_files_exist` resolves
    symbolic links)."""
    check_relpath(relpath, where or str(root))
    path = str(root / relpath)
    return Record(
        relpath=relpath,
        label=int(label),
        class_name=class_name,
        split=split,
        read=functools.partial(read_local_file, path),
        source=path,
    )


def check_files_exist(root: Path, records: list[Record], dataset: str) -> None:
    """Fail before writing anything if listed images are missing, or resolve (through symbolic links) to a file
    outside `root` — a link inside the dataset must not embed files from elsewhere.  `root` itself may be a
    link (resolved first)."""
    real_root = Path(os.path.realpath(root))
    missing = []
    for r in records:
        path = root / r.relpath
        if not os.path.isfile(path):
            missing.append(r.relpath)
            continue
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(real_root):
            raise LayoutError(
                f"{path}: {dataset}: is a symbolic link (or under one) to {real}, outside --src {real_root}"
            )
    if missing:
        raise DataFileNotFoundError(
            f"{root}: {dataset}: {len(missing)} listed images are missing under {root}, e.g. {missing[:10]}"
        )
