"""Where prepared datasets live: a local directory or an S3 prefix (`s3://bucket/prefix`).

`open_storage(uri, endpoint_url=None)` returns an object with the few operations the shard writer and reader need
(`put_file`, `put_bytes`, `get_file`, `get_bytes`, `exists`, `uri_of`), plus `delete` / `delete_tree` for fold
checkpoints (`dml_core.training.checkpoint`).  Keys are '/'-separated paths relative to
the root.  S3 goes through boto3; the endpoint is the explicit `endpoint_url` argument, else the standard
`AWS_ENDPOINT_URL` environment variable (SeaweedFS, MinIO, Ceph ...), else AWS itself.  Credentials come from
boto3's usual chain (environment variables, ~/.aws, instance roles).

The boto3 side lives in :mod:`dml_core.storage_s3`, loaded by the first S3 request.  S3 requests go through
botocore's own retry ("standard" mode: bounded exponential back-off with jitter on throttling,
5xx and connection errors) with connect/read timeouts, so a flaky endpoint delays a request instead of hanging it.

Storage objects are picklable: the boto3 client is created lazily in each process (DataLoader workers, Ray
actors), never shipped across a pickle.
"""

from __future__ import annotations

import os
import shutil
import uuid
import zipfile
from pathlib import Path, PurePosixPath
from types import ModuleType

__all__ = [
    "LocalStorage",
    "S3Storage",
    "open_storage",
    "is_s3_uri",
    "split_s3_uri",
    "read_errors",
    "s3_errors",
]


def is_s3_uri(uri: str | os.PathLike) -> bool:
    return str(uri).startswith("s3://")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ('bucket', 'a/b'); the prefix has no leading or trailing '/'."""
    if not is_s3_uri(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URI without a bucket: {uri!r}")
    return bucket, prefix.strip("/")


def _check_key(key: str) -> str:
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or ".." in parts:
        raise ValueError(f"storage key must be a relative path without '..': {key!r}")
    return key


class LocalStorage:
    """A directory on this machine (or a mounted shared file system)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def uri_of(self, key: str) -> str:
        return str(self.root / _check_key(key))

    def local_path(self, key: str) -> Path:
        """Local files are read in place: no copy into a cache."""
        return self.root / _check_key(key)

    def exists(self, key: str) -> bool:
        return (self.root / _check_key(key)).exists()

    def put_file(self, local_path: str | os.PathLike, key: str) -> None:
        dest = self.root / _check_key(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)  # atomic: a reader never sees half a file

    def put_bytes(self, data: bytes, key: str) -> None:
        dest = self.root / _check_key(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def get_bytes(self, key: str) -> bytes:
        path = self.root / _check_key(key)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return path.read_bytes()

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        shutil.copyfile(self.local_path(key), local_path)

    def delete(self, key: str) -> None:
        (self.root / _check_key(key)).unlink(missing_ok=True)

    def delete_tree(self) -> None:
        """Remove the whole root directory (nothing if absent)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _s3() -> ModuleType:
    """:mod:`dml_core.storage_s3`: the boto3 client and botocore's errors behind :class:`S3Storage`."""
    # boto3 / botocore (some 300 modules): only s3:// storage needs them; local folders never load them
    from dml_core import storage_s3

    return storage_s3


class S3Storage:
    """`s3://bucket/prefix` through boto3 (path-style addressing, which every S3-compatible server accepts)."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.bucket, self.prefix = split_s3_uri(uri)
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self._client = None

    def __repr__(self) -> str:
        return f"S3Storage('s3://{self.bucket}/{self.prefix}', endpoint_url={self.endpoint_url!r})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = None  # boto3 clients do not pickle; each process makes its own
        return state

    @property
    def client(self):
        if self._client is None:
            self._client = _s3().make_client(self.endpoint_url)
        return self._client

    def _key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def local_path(self, key: str) -> None:
        return None  # remote: readers download into their cache

    def exists(self, key: str) -> bool:
        s3 = _s3()
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except s3.ClientError as e:
            if s3.is_not_found(e):
                return False
            raise

    def put_file(self, local_path: str | os.PathLike, key: str) -> None:
        self.client.upload_file(str(local_path), self.bucket, self._key(key))

    def put_bytes(self, data: bytes, key: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        s3 = _s3()
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except s3.ClientError as e:
            if s3.is_not_found(e):
                raise FileNotFoundError(f"{self.uri_of(key)} does not exist") from e
            raise

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        self.client.download_file(self.bucket, self._key(key), str(local_path))

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_tree(self) -> None:
        """Delete every object under the prefix (the prefix must not be the bucket root)."""
        if not self.prefix:
            raise ValueError(f"refusing to empty the whole bucket s3://{self.bucket}")
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:  # at most 1000 per page, DeleteObjects' own limit
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a user's data can raise for a bad file, folder or bucket: the readers raise ``ValueError`` or
    ``OSError`` naming the file, the rest (a truncated zip, a missing column, botocore's errors when S3 answers
    no) is caught too, so that broken data is one line naming it, never a traceback."""
    errors: tuple[type[BaseException], ...] = (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        EOFError,
        zipfile.BadZipFile,
    )
    return (*errors, *s3_errors())


def s3_errors() -> tuple[type[BaseException], ...]:
    """botocore's errors (an S3 endpoint that refuses, a missing bucket or key), imported only when asked for."""
    try:
        # botocore's exceptions alone (not boto3's 300 modules, see _s3), loaded when a caller asks for them
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - boto3 is a dependency
        return ()
    return BotoCoreError, ClientError


def open_storage(uri: str | os.PathLike, endpoint_url: str | None = None) -> LocalStorage | S3Storage:
    """`s3://bucket/prefix` -> S3Storage; anything else is a local directory."""
    if is_s3_uri(uri):
        return S3Storage(str(uri), endpoint_url=endpoint_url)
    if endpoint_url:
        raise ValueError(f"endpoint_url={endpoint_url!r} given for a local destination {str(uri)!r}")
    return LocalStorage(uri)
