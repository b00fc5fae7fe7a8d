"""Image folders, `<root>/<class>/<image>` (torchvision `ImageFolder`), local or `s3://bucket/prefix`.

Labels: the class folders' sorted order 0..C-1, as `ImageFolder` gives them; class name = the folder's name in
Unicode NFC.  Images: files with an image extension (case-insensitive, `IMAGE_EXTENSIONS`) anywhere below their
class folder, sorted by path; other files are skipped.  `split` = `all` (a folder has no split of its own).

The scan fails fast, naming the root, instead of listing whatever tree it is given (a mistyped `/`, a home
directory, a bucket's root):

* the root of a file system (`/`) is refused outright;
* a class folder without images is an error as soon as that folder is listed;
* more than `max(MAX_OTHER_ENTRIES, images found so far)` entries that are not images (other files, and folders
  below the class level) is an error: the root is not an image folder;
* links are followed (as `ImageFolder` does) but must stay inside the root, and no folder or image may be reached
  twice (a link back to a parent would list the same images again and again);
* two class folders whose names differ only by case or Unicode normalisation, and a folder name with a control
  character (a newline ...), are refused naming the folders;
* hidden entries (a name starting with ".": `.ipynb_checkpoints/`, `.DS_Store`, macOS `._*` files) are neither
  classes nor images, at any level (torchvision's `ImageFolder` would make `.ipynb_checkpoints` a class).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dml_core.datasets._sources import NO_SPLIT, LocalRoot, S3Root, _inside, is_image_name, open_root
from dml_core.shards import (
    DataError,
    DataFileNotFoundError,
    LayoutError,
    Record,
    class_name_key,
    class_name_problem,
    nfc,
)

__all__ = ["scan", "records", "read_image_folder", "MAX_OTHER_ENTRIES", "LABEL_CONVENTION"]

NAME = "folder"
LABEL_CONVENTION = "label = index of the class folder in sorted folder-name order (torchvision ImageFolder, 0..C-1)"
#: Entries that are not images (files without an image extension, folders below the class level) tolerated before
#: the scan gives up, unless the images found so far outnumber them.
MAX_OTHER_ENTRIES = 10_000
LAYOUT = "the layout is <root>/<class>/<image>"


@dataclass(frozen=True)
class FolderScan:
    """What a scan found: class names (NFC, in label order) and (relpath, label) per image, sorted."""

    root: LocalRoot | S3Root
    class_names: list[str]
    rows: list[tuple[str, int]]


class _Budget:
    def __init__(self, root):
        self.root, self.other = root, 0

    def spend(self, rel: str, images: int) -> None:
        self.other += 1
        if self.other > max(MAX_OTHER_ENTRIES, images):
            raise LayoutError(
                f"{self.root}: does not look like an image folder ({LAYOUT}): {self.other} entries "
                f"are not images (e.g. {rel!r}) against {images} images so far; give the dataset's "
                "own root"
            )


def check_class_folders(names: list[str], root) -> None:
    """No control characters, no two names that differ only by case or Unicode normalisation."""
    first: dict[str, str] = {}
    for name in names:
        problem = class_name_problem(name)
        if problem:
            raise LayoutError(f"{root}: class folder {name!r} {problem}")
        other = first.setdefault(class_name_key(name), name)
        if other != name:
            raise LayoutError(
                f"{root}: class folders {other!r} and {name!r} differ only by case or Unicode normalisation"
            )


def _hidden(name: str) -> bool:
    """A hidden file or folder (notebook checkpoints, Finder metadata): never a class, never an image."""
    return name.startswith(".")


def _no_images(root, name: str) -> DataError:
    return DataError(f"{root}: class directories without images: [{name!r}] ({LAYOUT}; is {root} the dataset's root?)")


def _scan_local(root: LocalRoot) -> FolderScan:
    if os.path.dirname(root.real_root) == root.real_root:
        raise LayoutError(f"{root}: is the root of a file system, not an image folder ({LAYOUT})")
    budget = _Budget(root)
    with os.scandir(root.path) as it:
        top = sorted(it, key=lambda e: e.name)
    classes = []
    for e in top:
        if _hidden(e.name):
            continue
        if e.is_dir():
            classes.append(e.name)
        else:
            budget.spend(e.name, 0)
    if not classes:
        raise DataError(f"{root}: no class sub-directories ({LAYOUT})")
    check_class_folders(classes, root)
    seen_dirs: dict[str, str] = {root.real_root: "."}
    seen_files: dict[str, str] = {}
    rows: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        found: list[str] = []
        stack = [name]
        while stack:
            rel_dir = stack.pop()
            path = os.path.join(root.path, rel_dir)
            real_dir = os.path.realpath(path)
            if not _inside(real_dir, root.real_root):
                raise LayoutError(
                    f"{path}: is a symbolic link (or under one) to {real_dir}, outside the image folder {root}"
                )
            if real_dir in seen_dirs:
                raise LayoutError(
                    f"{path}: is a symbolic link to {real_dir}, a folder already listed as "
                    f"{seen_dirs[real_dir]!r} (a cycle, or one folder under two names)"
                )
            seen_dirs[real_dir] = rel_dir
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                rel = f"{rel_dir}/{e.name}"
                if _hidden(e.name):
                    continue
                if e.is_dir():
                    budget.spend(rel, len(rows) + len(found))
                    stack.append(rel)
                elif is_image_name(e.name):
                    if not e.is_file():
                        raise LayoutError(f"{e.path}: is not a regular file (a broken link or a device)")
                    real = os.path.realpath(e.path) if e.is_symlink() else os.path.join(real_dir, e.name)
                    if not _inside(real, root.real_root):
                        raise LayoutError(f"{e.path}: is a symbolic link to {real}, outside the image folder {root}")
                    if real in seen_files:
                        raise LayoutError(
                            f"{e.path}: is the same file as {seen_files[real]!r} (through a symbolic "
                            "link): one image would be listed twice"
                        )
                    seen_files[real] = rel
                    found.append(rel)
                else:
                    budget.spend(rel, len(rows) + len(found))
        if not found:
            raise _no_images(root, name)
        rows += [(rel, label) for rel in sorted(found)]
    return FolderScan(root, [nfc(c) for c in classes], rows)


def _scan_s3(root: S3Root) -> FolderScan:
    budget = _Budget(root)
    by_class: dict[str, list[str]] = {}
    images = 0
    for rel in root.iter_keys():
        if not rel or rel.endswith("/"):
            continue  # a "folder" marker object
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise LayoutError(f"{root.source(rel)}: key has an empty, '.' or '..' path component")
        if any(_hidden(p) for p in parts):
            continue
        if len(parts) < 2:
            budget.spend(rel, images)
            continue
        files = by_class.setdefault(parts[0], [])
        if is_image_name(rel):
            files.append(rel)
            images += 1
        else:
            budget.spend(rel, images)
    if not by_class:
        raise DataError(f"{root}: no class sub-directories ({LAYOUT})")
    classes = sorted(by_class)
    check_class_folders(classes, root)
    rows = []
    for label, name in enumerate(classes):
        if not by_class[name]:
            raise _no_images(root, name)
        rows += [(rel, label) for rel in sorted(by_class[name])]
    root._keys = {rel for rel, _ in rows}
    return FolderScan(root, [nfc(c) for c in classes], rows)


def scan(root: str | os.PathLike, *, endpoint_url: str | None = None) -> FolderScan:
    """List an image folder (local or s3://), with the fail-fast rules of this module."""
    if not str(root).startswith("s3://") and not Path(root).is_dir():
        raise DataFileNotFoundError(f"{root}: image folder root is not a directory")
    r = open_root(root, endpoint_url)
    return _scan_s3(r) if isinstance(r, S3Root) else _scan_local(r)


def records(src: str | os.PathLike, *, endpoint_url: str | None = None) -> list[Record]:
    """One `Record` per image, for `write_shards` (`dmlrc data prepare folder`)."""
    s = scan(src, endpoint_url=endpoint_url)
    return [
        Record(
            relpath=rel,
            label=label,
            class_name=s.class_names[label],
            split=NO_SPLIT,
            read=s.root.reader(rel),
            source=s.root.source(rel),
        )
        for rel, label in s.rows
    ]


def read_image_folder(root: str | os.PathLike, *, endpoint_url: str | None = None):
    """An image folder as an `ImageTable`: rows are file paths (local) or image bytes (S3, read now: prepare
    shards for anything large), labels int64 in `ImageFolder` order, meta `relpath` and `split` (`all`)."""
    # torch: only reading into an ImageTable needs it; prepare's records() (`dmlrc data`) does not
    from dml_core.data import ImageTable

    s = scan(root, endpoint_url=endpoint_url)
    rels = [rel for rel, _ in s.rows]
    images = [s.root.reader(rel)() for rel in rels] if s.root.remote else [s.root.source(rel) for rel in rels]
    return ImageTable(
        images=images,
        labels=np.array([label for _, label in s.rows], dtype=np.int64),
        class_names=list(s.class_names),
        meta={"relpath": np.array(rels, dtype=str), "split": np.array([NO_SPLIT] * len(rels))},
    )
