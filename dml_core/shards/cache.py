"""Making a shard local and known-good: S3 shards are downloaded into a content-addressed cache dir
(`<sha256>.parquet`, one download per host under a file lock); local shards are read in place once they hashed to the
manifest's sha256.  A stamp (sha256 -> path, device, inode, size, mtime, ctime) lets later reads skip re-hashing an
unchanged file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from dml_core.shards.errors import DataFileNotFoundError, ShardChecksumError
from dml_core.storage import LocalStorage, S3Storage

_fcntl: ModuleType | None
try:
    import fcntl as _fcntl  # POSIX only: elsewhere the shard download lock is a no-op
except ImportError:  # pragma: no cover - non-POSIX
    _fcntl = None

__all__ = ["default_cache_dir", "sha256_file", "download_verified", "verify_in_place"]


def default_cache_dir() -> Path:
    """`$DMLRC_CACHE_DIR`, else ~/.cache/dmlrc; shards go to its `shards/` sub-directory."""
    return Path(os.environ.get("DMLRC_CACHE_DIR") or Path.home() / ".cache" / "dmlrc").expanduser()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock so that DataLoader workers on one host download a shard once (no-op without fcntl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if _fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as f:
        _fcntl.flock(f, _fcntl.LOCK_EX)
        try:
            yield
        finally:
            _fcntl.flock(f, _fcntl.LOCK_UN)


def download_verified(
    storage: LocalStorage | S3Storage, key: str, expected: str, cache: Path, *, rehash: bool = False
) -> Path:
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
            got = sha256_file(tmp)
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
    if sha256_file(path) != expected:
        return False
    _write_stamp(path, expected, stamps)
    return True


def verify_in_place(path: Path, expected: str, stamps: Path, name: str, *, rehash: bool = False) -> Path:
    """A local shard is read in place once it hashed to the manifest's sha256 (stamped, see `_stamp_ok`)."""
    if not path.is_file():
        raise DataFileNotFoundError(f"{path}: shard {name} listed in the manifest is missing")
    if not _stamp_ok(path, expected, stamps, rehash):
        raise ShardChecksumError(
            f"{path}: shard {name} sha256 {sha256_file(path)} does not match the manifest's {expected}"
        )
    return path
