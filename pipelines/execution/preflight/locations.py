"""Where a sweep writes — its folder, a sqlite DB, an MLflow server, a PostgreSQL store — checked before anything
is written, without creating anything."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from pipelines.config import ConfigError, SweepConfig, redact_uri
from pipelines.tracking.server import check_mlflow_server

__all__ = ["check_locations", "check_dir_writable"]


def _nearest_existing(path: Path, field_name: str) -> Path:
    p = path
    while True:
        try:
            if p.exists():
                return p
            if p.is_symlink():
                raise ConfigError(field_name, f"{str(p)!r} is a broken symbolic link")
        except OSError as e:
            raise ConfigError(field_name, f"{str(p)!r}: {e.strerror or e}") from None
        if p.parent == p:
            return p
        p = p.parent


def check_dir_writable(target: Path, field_name: str, what: str) -> None:
    """``target`` is, or can be created as, a writable directory — checked without creating anything."""
    p = _nearest_existing(target, field_name)
    if not p.is_dir():
        raise ConfigError(field_name, f"{what} {str(target)!r}: {str(p)!r} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(field_name, f"{what} {str(target)!r}: {str(p)!r} is not writable")
    # os.access answers yes to root everywhere, also where no file can be made (/proc, a read-only mount): try it
    # with an unnamed file (O_TMPFILE where the file system has it, else created and removed at once)
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ConfigError(
            field_name, f"{what} {str(target)!r}: no file can be created in {str(p)!r} ({e.strerror or e})"
        ) from None


def check_locations(cfg: SweepConfig) -> None:
    """Storage and a sqlite tracking DB must be writable, a PostgreSQL driver installed — before anything is written
    (MLflow retries an unwritable sqlite DB for minutes before it gives up)."""
    storage_field = "storage" if not cfg.storage_is_s3 else "storage (its local folder ./runs)"
    check_dir_writable(cfg.local_dir(), storage_field, "sweep folder")
    uri = cfg.tracking_uri()
    uri_field = (
        "tracking.uri"
        if cfg.tracking.uri
        else ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "storage")
    )
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        try:
            exists = db.exists()
        except OSError as e:
            raise ConfigError(uri_field, f"sqlite DB {str(db)!r}: {e.strerror or e}") from None
        if exists:
            if not db.is_file():
                raise ConfigError(uri_field, f"sqlite DB {str(db)!r} is not a file")
            if not os.access(db, os.R_OK | os.W_OK) or not os.access(db.parent, os.W_OK | os.X_OK):
                raise ConfigError(uri_field, f"sqlite DB {str(db)!r} (or its folder) is not writable")
            check_dir_writable(db.parent, uri_field, "folder of the sqlite DB")  # sqlite writes its journal there
        else:
            check_dir_writable(db.parent, uri_field, "folder of the sqlite DB")
    elif uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, uri_field)
    elif uri.startswith("postgresql"):
        driver = uri.split("://", 1)[0].partition("+")[2] or "psycopg"
        if importlib.util.find_spec(driver) is None:
            raise ConfigError(
                uri_field,
                f"{redact_uri(uri)}: the PostgreSQL driver {driver!r} is not installed "
                "(use postgresql+psycopg2:// with psycopg2)",
            )
