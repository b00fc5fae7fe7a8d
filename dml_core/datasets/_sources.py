"""Where the images of a `folder` or `csv` dataset live: a local directory or an S3 prefix (`s3://bucket/prefix`).

`open_root(uri, endpoint_url)` returns a `LocalRoot` or an `S3Root` with the few operations the folder and CSV
readers need: name an image (`source`), read it (`reader`), say why a listed image cannot be used (`problem`:
missing, or a symbolic link out of the root) and, for duplicate detection, the real file behind a path (`real`).
An S3 root lists its prefix once (one request per 1,000 keys) instead of asking for every image.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

from dml_core.shards import DataError, DataFileNotFoundError
from dml_core.storage import S3Storage, is_s3_uri

#: torchvision.datasets.folder.IMG_EXTENSIONS, as `dml_core.data.IMAGE_EXTENSIONS` (kept here so that listing a
#: dataset does not import torch).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: The `split` of every row of a dataset that has no split of its own (an image folder, a CSV without `split`).
NO_SPLIT = "all"


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def read_local_file(path: str) -> bytes:
    """The bytes of a local image file: what a record's ``read`` calls (a module-level function, so that a
    ``functools.partial`` of it pickles to the processes that write shards)."""
    with open(path, "rb") as f:
        return f.read()


def _inside(real: str, real_root: str) -> bool:
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


class LocalRoot:
    """A directory on this machine; symbolic links are followed but must stay inside it."""

    remote = False

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.real_root = os.path.realpath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def source(self, rel: str) -> str:
        return str(self.path / rel)

    def reader(self, rel: str):
        return functools.partial(read_local_file, self.source(rel))

    def real(self, rel: str) -> str:
        return os.path.realpath(self.path / rel)

    def problem(self, rel: str) -> str | None:
        """Why the image at `rel` cannot be used (the text follows `image 'rel' `), or None."""
        path = self.path / rel
        if not os.path.lexists(path):
            return f"not found under {self.path}"
        if not os.path.isfile(path):
            return f"is not a regular file under {self.path} (a folder, a broken link or a device)"
        real = self.real(rel)
        if not _inside(real, self.real_root):
            return f"is a symbolic link (or under one) to {real}, outside the root {self.path}"
        return None


class S3Root:
    """`s3://bucket/prefix`; its keys are listed once, lazily."""

    remote = True

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        self.storage = S3Storage(self.uri, endpoint_url=endpoint_url)
        self._keys: set[str] | None = None

    def __str__(self) -> str:
        return self.uri

    def source(self, rel: str) -> str:
        return self.storage.uri_of(rel)

    def reader(self, rel: str):
        return functools.partial(self.storage.get_bytes, rel)

    def real(self, rel: str) -> str:
        return rel  # no links on S3

    def iter_keys(self) -> Iterator[str]:
        """Every key under the prefix, relative to it, page by page (so a caller can stop early)."""
        prefix = f"{self.storage.prefix}/" if self.storage.prefix else ""
        pages = self.storage.client.get_paginator("list_objects_v2").paginate(Bucket=self.storage.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][len(prefix) :]

    def keys(self) -> set[str]:
        if self._keys is None:
            self._keys = set(self.iter_keys())
        return self._keys

    def problem(self, rel: str) -> str | None:
        return None if rel in self.keys() else f"not found under {self.uri}"


def open_root(uri: str | os.PathLike, endpoint_url: str | None = None, *, must_exist: bool = True):
    """`s3://...` -> S3Root (through `endpoint_url`, else $AWS_ENDPOINT_URL); anything else -> LocalRoot, which must
    be a directory."""
    if is_s3_uri(uri):
        try:
            return S3Root(str(uri), endpoint_url=endpoint_url)
        except ValueError as e:
            raise DataError(f"{uri}: {e}") from None
    root = LocalRoot(uri)
    if must_exist and not root.path.is_dir():
        raise DataFileNotFoundError(f"{root.path}: not a directory (the images' root)")
    return root
