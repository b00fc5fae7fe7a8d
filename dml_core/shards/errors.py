"""The errors of bad data: every one is a `DataError` (a ValueError) whose message starts with the file (and row)
at fault, so a CLI prints it as one line."""

from __future__ import annotations

__all__ = [
    "DataError",
    "DataFileNotFoundError",
    "DataExistsError",
    "ShardChecksumError",
    "CorruptImageError",
    "ManifestError",
    "LayoutError",
]


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
