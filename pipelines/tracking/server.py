"""An MLflow tracking server's health, asked in seconds (MLflow's own client retries for minutes)."""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit

from pipelines.config import ConfigError, redact_uri

__all__ = ["health_url", "answers", "check_mlflow_server"]


def health_url(uri: str) -> str:
    """``<server>/health`` without the credentials (urllib cannot take ``user:password@`` in a URL; the health
    endpoint needs none)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))


def answers(uri: str, timeout: float = 2.0) -> bool:
    """Whether the MLflow server at ``uri`` answers its ``/health`` with 200 now (one probe, for polling)."""
    try:
        with urllib.request.urlopen(health_url(uri), timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def check_mlflow_server(uri: str, field_name: str) -> None:
    """An ``http(s)://`` MLflow server answers its ``/health`` (credentials stripped from the probe and from the
    message), else one ``ConfigError`` naming ``field_name`` — seconds, not MLflow's minutes of retries."""
    try:
        with urllib.request.urlopen(health_url(uri), timeout=10) as r:
            r.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(
            field_name,
            f"MLflow server {redact_uri(uri)} is not reachable "
            f"({redact_uri(' '.join(str(e).split()) or type(e).__name__)})",
        ) from None
