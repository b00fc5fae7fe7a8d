"""Ray start-up and the infrastructure checks a sweep makes before Ray starts.

Everything here runs on the driver: the environment Ray and its workers get (:data:`RAY_ENV`, :data:`S3_ENV`),
the reachability checks for the sweep's storage and tracking server (each fails with a one-line
``config error: <field>: …`` before anything expensive starts), and :func:`start_ray`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from pipelines.config import ConfigError, SweepConfig

__all__ = ["RAY_ENV", "S3_ENV", "s3_compat_env", "check_storage_reachable", "check_tracking_reachable",
           "default_num_cpus", "start_ray", "warn_multi_node"]

#: Set before Ray is imported/started: Train V2, quiet start-up, no usage stats, all worker lines shown.
RAY_ENV = {
    "RAY_TRAIN_V2_ENABLED": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "TUNE_GLOBAL_CHECKPOINT_S": "2",
    "RAY_TRAIN_ENABLE_STATE_TRACKING": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_AIR_NEW_OUTPUT": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "60",
}

#: S3 settings the driver hands to its Ray workers.  Credentials are not among them: local workers inherit the
#: driver's environment, and a remote cluster's nodes use their own (instance roles, pod secrets).
S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "MLFLOW_S3_ENDPOINT_URL",
          "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")


def s3_compat_env() -> None:
    """With a non-AWS S3 endpoint, send request checksums only where the API requires them.

    Recent AWS SDKs (the C++ one inside pyarrow, which Ray uses for its storage) default to streaming
    checksum trailers on uploads; S3-compatible servers that predate them (SeaweedFS, older MinIO/Ceph)
    reject those multipart uploads with a misleading auth error.  An explicit setting in the environment wins.
    """
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")


def check_storage_reachable(cfg: SweepConfig) -> None:
    """Fail before Ray starts when ``storage: s3://bucket/...`` cannot be reached (names ``storage``)."""
    if not cfg.storage_is_s3:
        return
    import boto3
    import botocore.exceptions

    from dml_core.storage import split_s3_uri

    bucket, _ = split_s3_uri(cfg.storage)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
    try:
        boto3.client("s3").head_bucket(Bucket=bucket)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise ConfigError("storage", f"S3 bucket {bucket!r} at {endpoint} is not reachable ({e}); set "
                                     "AWS_ENDPOINT_URL and credentials for a non-AWS server") from None


def check_tracking_reachable(uri: str) -> None:
    """Fail before Ray starts when an HTTP tracking server does not answer (names ``tracking.uri``)."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as r:
            r.read()
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError("tracking.uri", f"MLflow server {uri} is not reachable ({e})") from None


def default_num_cpus(cfg: SweepConfig) -> int:
    r = cfg.resources
    need = r.max_concurrent_trials * cfg.protocol.folds * r.workers_per_fold * r.cpus_per_worker
    return int(max(os.cpu_count() or 1, math.ceil(need) + 1))


def start_ray(cfg: SweepConfig, address: str | None) -> bool:
    """Start (or connect to) Ray; returns whether we started it (and so must shut it down)."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    s3_compat_env()
    import ray

    from pipelines.fold import worker_env

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        # Workers, Train controllers and their placement-group cleaners log at INFO/WARNING a lot (the cleaners
        # poll the State API, which needs the dashboard we do not start); our progress lines are prints.
        logging_config=ray.LoggingConfig(log_level=os.environ.get("DMLRC_RAY_LOG_LEVEL", "ERROR")),
        runtime_env={"env_vars": {**worker_env(), **{k: os.environ[k] for k in RAY_ENV},
                                  **{k: os.environ[k] for k in S3_ENV if k in os.environ}}},
    )
    if address:
        ray.init(address=address, **kwargs)
    else:
        # One machine cannot be preempted node by node: skip Train's per-run preemption-watcher actor.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        kwargs["runtime_env"]["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        for attempt in range(3):
            try:
                ray.init(num_cpus=cfg.resources.num_cpus or default_num_cpus(cfg), **kwargs)
                break
            except Exception as e:  # noqa: BLE001 - only Ray's start-up timeout is retried
                # Ray waits a fixed 30 s for its raylet to register; a saturated machine can miss that.
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                ray.shutdown()
                time.sleep(5)
    for name in ("ray.tune", "ray.train", "ray.air", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return True


def warn_multi_node(cfg: SweepConfig, uri: str, out) -> None:
    """On a multi-node cluster, local storage and a sqlite/file tracking store only work through a shared mount."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    if not cfg.storage_is_s3:
        print(f"warning: storage: {cfg.ray_storage()} is a local path on a {len(nodes)}-node cluster; it must be a "
              "shared mount (NFS) on every node, else use s3://", file=out, flush=True)
    if not uri.startswith(("http://", "https://", "postgresql")):
        print(f"warning: tracking.uri: {uri} on a {len(nodes)}-node cluster; fold workers on other nodes log to "
              "MLflow too — use an MLflow server (http(s)://)", file=out, flush=True)
