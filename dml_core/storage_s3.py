"""boto3 and botocore behind :class:`dml_core.storage.S3Storage`: the client (path-style addressing, botocore's
"standard" retries, connect/read timeouts) and the not-found test.  :mod:`dml_core.storage` imports this module with
the first S3 request, so a local folder never loads boto3."""

from __future__ import annotations

import os

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

__all__ = ["S3_MAX_ATTEMPTS", "S3_CONNECT_TIMEOUT", "S3_READ_TIMEOUT", "ClientError", "make_client", "is_not_found"]

#: botocore "standard" retry mode: attempts per request (first try included) and timeouts in seconds.
S3_MAX_ATTEMPTS = 6
S3_CONNECT_TIMEOUT = 10
S3_READ_TIMEOUT = 60


def make_client(endpoint_url: str | None):
    """An S3 client for ``endpoint_url`` (``None``: AWS), region from ``AWS_DEFAULT_REGION`` / ``AWS_REGION``."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"},
            connect_timeout=S3_CONNECT_TIMEOUT,
            read_timeout=S3_READ_TIMEOUT,
        ),
    )


def is_not_found(e: ClientError) -> bool:
    """The error S3 answers for a missing key (or bucket)."""
    return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")
