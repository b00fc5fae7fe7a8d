"""Helpers shared by the official-layout readers: find files, parse whitespace tables with clear errors."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from dml_core.shards import Record


def find_file(src: Path, candidates: list[str], dataset: str) -> Path:
    """The first existing `src / c`; else FileNotFoundError listing where we looked."""
    for c in candidates:
        p = src / c
        if p.is_file():
            return p
    raise FileNotFoundError(f"{dataset}: none of {[str(src / c) for c in candidates]} exists "
                            f"(is --src the dataset's official directory?)")


def read_rows(path: Path, n_fields: int, *, skip: int = 0, dataset: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-empty line after `skip` lines; every line must have `n_fields` fields."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if lineno <= skip or not line.strip():
                continue
            fields = line.split()
            if len(fields) != n_fields:
                raise ValueError(f"{dataset}: {path} line {lineno}: expected {n_fields} fields, got {len(fields)}: "
                                 f"{line.rstrip()!r}")
            rows.append((lineno, fields))
    if not rows:
        raise ValueError(f"{dataset}: {path} has no rows")
    return rows


def to_int(value: str, path: Path, lineno: int, field: str, dataset: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{dataset}: {path} line {lineno}: {field} {value!r} is not an integer") from None


def file_record(root: Path, relpath: str, label: int, class_name: str, split: str) -> Record:
    return Record(relpath=relpath, label=int(label), class_name=class_name, split=split,
                  read=functools.partial(_read_bytes, str(root / relpath)))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_files_exist(root: Path, records: list[Record], dataset: str) -> None:
    """Fail before writing anything if listed images are missing."""
    missing = [r.relpath for r in records if not os.path.isfile(root / r.relpath)]
    if missing:
        raise FileNotFoundError(f"{dataset}: {len(missing)} listed images are missing under {root}, e.g. "
                                f"{missing[:10]}")
