"""Paths and URIs of a config: storage and dataset locations, MLflow tracking URIs, credentials kept out of messages."""

from __future__ import annotations

import importlib.util
import re
import stat
from pathlib import Path
from urllib.parse import urlsplit

from pipelines.config.errors import ConfigError

# Redaction lives with the error messages; its names stay importable from here.
from pipelines.config.redact import redact_uri, secret_query_name, shown

__all__ = [
    "redact_uri",
    "secret_query_name",
    "shown",
    "check_uri",
    "special_file",
    "check_tracking_uri",
    "absolute_tracking_uri",
    "local_path",
    "check_ray_address",
    "TRACKING_SCHEMES",
]

TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql")
#: Something that looks like a URI scheme followed by too few slashes (``s3:/bucket``): a typo, not a local path.
_BROKEN_SCHEME_RE = re.compile(r"^(s3|gs|gcs|az|abfs|hdfs|https?|file|sqlite|postgresql):/?(?!/)", re.IGNORECASE)


def local_path(v: str, where: str) -> Path:
    """A local path as the user means it: ``~`` expanded, made absolute; a symbolic-link loop is one error naming
    ``where`` (``Path.resolve`` raises RuntimeError on one)."""
    try:
        return Path(v).expanduser().resolve()
    except (RuntimeError, OSError) as e:
        raise ConfigError(where, f"{shown(v)}: {'symbolic link loop' if isinstance(e, RuntimeError) else e}") from None


def special_file(path: Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (``"a character device"``, ``"a
    FIFO"``, ...), else None.  Asked with ``stat``, never by opening it: opening a FIFO blocks until a writer comes,
    and reading ``/dev/zero`` never ends."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # missing or unreadable: whoever opens it says so
    for test, what in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return None


def check_uri(uri: str, where: str, *, allow_s3: bool = True) -> str:
    """A local path or ``s3://bucket[/prefix]``; any other ``scheme://`` is an error naming ``where``."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(where, f"expected a path or URI, got {shown(uri)}")
    if "\x00" in uri:
        raise ConfigError(where, "contains a NUL character")
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", uri)
    if not m:
        broken = _BROKEN_SCHEME_RE.match(uri)
        if broken:  # "s3:/bucket/x", "s3:bucket": a mistyped URI would otherwise become a folder named "s3:"
            raise ConfigError(
                where,
                f"{shown(uri)} looks like a {broken.group(1)}:// URI with a missing '/' "
                f"(write {broken.group(1).lower()}://...; a local path cannot start with "
                f"'{broken.group(1)}:')",
            )
        return uri
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "s3" and allow_s3 and "@" in rest.partition("/")[0]:
        # an access key and secret as user:password@ would reach S3's error messages: never echo them
        raise ConfigError(
            where,
            f"'s3://…@{rest.partition('/')[0].rpartition('@')[2]}': credentials do not belong in an s3:// URI; "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead",
        )
    if scheme == "s3" and allow_s3:
        if not rest or rest.startswith("/") or not re.match(r"^[a-z0-9][a-z0-9.-]{1,62}(/|$)", rest):
            raise ConfigError(where, f"{shown(uri)} is not a valid s3://bucket/prefix URI")
        return "s3://" + rest  # S3://bucket is s3://bucket (every reader below matches the lower-case scheme)
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(where, f"{shown(uri)}: a file:// URI must be absolute (file:///...)")
        return rest
    allowed = "a local path or s3://bucket/prefix" if allow_s3 else "a local path"
    raise ConfigError(where, f"unsupported URI scheme {scheme!r} in {shown(uri)} (expected {allowed})")


def check_tracking_uri(uri: str, where: str = "tracking.uri") -> str:
    """An MLflow tracking URI: ``http(s)://[user[:password]@]host[:port]``, ``sqlite:///path``,
    ``postgresql[+psycopg2]://user[:password]@host[:port]/database``.  ``file://`` stores are refused: MLflow 3
    no longer accepts them as a tracking store (use ``sqlite:///path/mlflow.db``)."""
    text = shown(uri)
    m = re.match(r"^([A-Za-z][A-Za-z0-9]*)(\+[A-Za-z0-9_]+)?://(.*)$", uri or "")
    if not m:
        raise ConfigError(
            where, f"{text} is not a URI (expected one of {', '.join(s + '://' for s in TRACKING_SCHEMES)})"
        )
    scheme, driver, rest = m.group(1).lower(), (m.group(2) or "")[1:].lower(), m.group(3)
    if scheme == "file":
        raise ConfigError(
            where,
            f"{text}: file:// tracking stores are not supported by MLflow 3; "
            "use sqlite:///path/mlflow.db (or an http:// server)",
        )
    if scheme not in TRACKING_SCHEMES:
        raise ConfigError(
            where, f"unsupported scheme {scheme!r} in {text} (expected one of {', '.join(TRACKING_SCHEMES)})"
        )
    if driver and scheme != "postgresql":
        raise ConfigError(where, f"{text}: a '+driver' suffix is only meaningful for postgresql")
    if driver and driver not in ("psycopg2", "psycopg"):
        raise ConfigError(where, f"{text}: unknown PostgreSQL driver {driver!r} (use postgresql+psycopg2://)")
    if scheme in ("http", "https", "postgresql"):
        try:
            parts = urlsplit(f"{scheme}://{rest}")
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise ConfigError(where, f"{text}: malformed host or port ({redact_uri(str(e))})") from None
        if not host or not re.match(r"^[A-Za-z0-9.\-_:]+$", host):
            raise ConfigError(where, f"{text}: missing or malformed host")
        if port is not None and not 0 < port < 65536:
            raise ConfigError(where, f"{text}: port out of range")
        if scheme == "postgresql" and not parts.path.strip("/"):
            raise ConfigError(where, f"{text}: expected postgresql://user[:password]@host[:port]/database")
    if scheme == "sqlite":
        if not rest.startswith("/") or rest == "/" or rest.endswith("/"):
            raise ConfigError(where, f"{text}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
    return uri


def absolute_tracking_uri(uri: str) -> str:
    """Make a ``sqlite:///relative.db`` URI absolute (workers must never resolve relative paths: ray #18387), and
    pin ``postgresql://`` to the installed driver (SQLAlchemy 2.1 maps the bare scheme to psycopg 3)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    if uri.startswith("postgresql://"):
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + uri[len("postgresql://") :]
    return uri


_RAY_ADDRESS_RE = re.compile(r"^(?:(ray)://)?(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})$")


def check_ray_address(address: str, where: str) -> str:
    """A Ray cluster address: ``auto``, ``host:port`` (the GCS of a running cluster) or ``ray://host:port`` (Ray
    Client, needs ``ray[client]``).  A malformed one, one with credentials, or a ``ray://`` one without the client is
    one error naming ``where`` (``--address`` or ``RAY_ADDRESS``); whether anything answers there is checked when Ray
    connects."""
    if not isinstance(address, str) or not address.strip():
        raise ConfigError(where, "must not be empty (omit it to start a local Ray)")
    if address == "auto":
        return address
    if "@" in address:
        host = address.rpartition("@")[2]  # never echo what stands before the '@'
        raise ConfigError(
            where,
            f"'…@{host}': credentials do not belong in a Ray address (a Ray cluster "
            "authenticates by its network; use a port-forward or VPN)",
        )
    m = _RAY_ADDRESS_RE.match(address)
    if not m or not 0 < int(m.group(3)) < 65536:
        raise ConfigError(where, f"{shown(address)} is not a Ray address (expected auto, host:port or ray://host:port)")
    if m.group(1):
        if importlib.util.find_spec("grpc") is None:
            raise ConfigError(
                where,
                f"{shown(address)}: ray:// addresses go through Ray Client, which needs pip install 'ray[client]'",
            )
    return address
