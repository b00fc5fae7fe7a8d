"""What Ray is started with, and the infrastructure checks a sweep makes before Ray starts (this module does not
import Ray: :mod:`pipelines.execution.runtime.session` starts it, once these checks have passed).

Everything here runs on the driver: the environment Ray and its workers get (:data:`RAY_ENV`, :data:`S3_ENV`,
:func:`worker_env`), the reachability checks for the sweep's storage and tracking store (each fails with a one-line
``config error: <field>: …`` before anything expensive starts), the trial drivers' resource, the credentials kept out
of Ray, and what starting Ray changed in this process (:data:`UNDO`, undone by :func:`undo_settings`).

Security:

* **No credentials in Ray's runtime_env.**  Ray Tune copies ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN`` and ``AWS_SECURITY_TOKEN`` from the driver's environment into every trainable's
  ``runtime_env`` (``ray/tune/execution/class_cache.py``, ``ENV_VARS_TO_PROPAGATE``; Ray 2.60 has no switch
  for it), and Ray's runtime-env agent logs each runtime_env in plain text under the session directory.  For the
  duration of the sweep :func:`hide_credentials` (called as Ray starts) therefore moves those variables out of the
  environment into a private AWS shared-credentials file (mode 0600 in a 0700 directory, on the memory-backed
  ``/dev/shm`` where there is one) named by ``AWS_SHARED_CREDENTIALS_FILE`` — the SDKs' standard second source, read
  by boto3 (MLflow) and by pyarrow's AWS SDK (Ray storage) alike — and :func:`undo_settings` (as Ray stops) puts
  them back and deletes the file.  A driver killed outright (SIGKILL, the OOM killer) cannot delete it: the folder
  carries the driver's pid, and the next sweep of the same user on that machine deletes the folders of drivers that
  are gone (:func:`remove_stale_credentials`).  Workers of a local Ray inherit the driver's environment (so the
  file's path); on a cluster the nodes use their own environment or instance role: credentials are never shipped
  through Ray.
* **No passwords printed.**  :func:`redact_uri` turns ``scheme://user:password@host`` into
  ``scheme://user:***@host`` for every message.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any
from urllib.parse import unquote

from dml_core.storage import split_s3_uri
from pipelines.config import ConfigError, SweepConfig, redact_uri
from pipelines.tracking.server import check_mlflow_server

__all__ = [
    "RAY_ENV",
    "S3_ENV",
    "AWS_SECRET_ENV",
    "s3_compat_env",
    "CREDENTIALS_PARENT",
    "remove_stale_credentials",
    "check_storage_reachable",
    "check_tracking_reachable",
    "apply_ray_env",
    "worker_env",
    "hide_credentials",
    "undo_settings",
    "UNDO",
    "WORKER_SETUP_HOOK",
    "redact_uri",
    "scrub",
    "TRIAL_DRIVER_RESOURCE",
    "TRIAL_DRIVER_SLOTS",
    "trial_bundle",
]

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
    # Ctrl-C is the sweep's (pipelines.execution.runtime.interrupts): Tune's handler would end only the current Tuner,
    # quietly, and let the sweep go on with the next one.
    "TUNE_DISABLE_SIGINT_HANDLER": "1",
    # the driver downloads fold models to register them: no progress bar per artifact in the sweep's output
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def worker_env() -> dict[str, str]:
    """Environment for Ray workers: quiet, deterministic-enough, Train V2."""
    return {
        "RAY_TRAIN_V2_ENABLED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }


#: S3 settings the driver hands to its Ray workers.  Credentials are not among them: local workers inherit the
#: driver's environment, and a remote cluster's nodes use their own (instance roles, pod secrets).
S3_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


#: What Ray Tune copies into every trainable's runtime_env (ray/tune/execution/class_cache.py): kept out of the
#: environment while Ray runs (see the module docstring).
AWS_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_CREDENTIAL_FILE_KEYS = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_SECURITY_TOKEN": "aws_security_token",
}

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/@:]*):([^/]*)@")


def scrub(text: str, uri: str | None) -> str:
    """``text`` with ``uri``'s password (if any) replaced by ``***`` wherever it occurs (e.g. in a driver's error)."""
    m = _USERINFO.match(uri or "")
    if not m or not m.group(2):
        return text

    for secret in {m.group(2), unquote(m.group(2))}:
        text = text.replace(secret, "***")
    return text


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
    # boto3 / botocore only for s3:// storage: a local sweep never loads them
    import boto3
    import botocore.exceptions

    bucket, _ = split_s3_uri(cfg.storage)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
    try:
        boto3.client("s3").head_bucket(Bucket=bucket)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise ConfigError(
            "storage",
            f"S3 bucket {bucket!r} at {endpoint} is not reachable ({e}); set "
            "AWS_ENDPOINT_URL and credentials for a non-AWS server",
        ) from None


def check_tracking_reachable(uri: str) -> None:
    """Fail before Ray starts when an HTTP tracking server or a PostgreSQL store does not answer, or the
    PostgreSQL driver the URI names is not installed (names ``tracking.uri``; never prints a password)."""
    if uri.startswith("postgresql"):
        _check_postgres(uri)
        return
    if uri.startswith(("http://", "https://")):
        check_mlflow_server(uri, "tracking.uri")


def _check_postgres(uri: str) -> None:
    """Connect once, through SQLAlchemy as MLflow will (``postgresql://`` = psycopg 3 since SQLAlchemy 2.1,
    ``postgresql+psycopg2://`` = psycopg2), with a short connect timeout instead of MLflow's minutes of retries."""
    # SQLAlchemy (and a PostgreSQL driver) only for a postgresql:// tracking store
    import sqlalchemy

    shown = redact_uri(uri)
    try:
        engine = sqlalchemy.create_engine(uri, connect_args={"connect_timeout": 10}, poolclass=sqlalchemy.pool.NullPool)
    except ModuleNotFoundError as e:
        raise ConfigError(
            "tracking.uri",
            f"{shown}: the PostgreSQL driver is not installed ({e}); install "
            "psycopg (pip install 'psycopg[binary]') or name psycopg2 in the URI: "
            "postgresql+psycopg2://...",
        ) from None
    except Exception as e:  # SQLAlchemy's URL/argument errors: one line, the field named
        raise ConfigError("tracking.uri", scrub(f"{shown}: {e}", uri)) from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # OperationalError & co.: say which server, keep it to one line
        detail = " ".join(str(getattr(e, "orig", None) or e).split())
        raise ConfigError("tracking.uri", scrub(f"PostgreSQL {shown} is not reachable ({detail})", uri)) from None
    finally:
        engine.dispose()


#: The custom resource that marks the node(s) where trial drivers (Tune's trial actors, 0 CPU of real work each)
#: belong: the node the sweep is driven from, which is not preemptible (Ray's fault-tolerance advice: keep driver
#: functions on safe nodes, chosen with a custom resource).  A Ray the sweep starts declares it; on a cluster the head
#: declares it (``ray start --head --resources '{"dmlrc_trial_driver": 10000}'``, infra/ray/).  Without it a trial
#: reserves 0.01 CPU on any node — which takes a whole fold slot out of a node whose CPUs are all fold slots, and
#: puts the trial on a node that may be lost with its folds.
TRIAL_DRIVER_RESOURCE = "dmlrc_trial_driver"
TRIAL_DRIVER_SLOTS = 10_000  # each trial takes 1: no limit in practice (Tune's max_concurrent_trials limits trials)


def trial_bundle(cluster_resources: dict[str, float]) -> dict[str, float]:
    """The resources of one trial driver's placement-group bundle (see :data:`TRIAL_DRIVER_RESOURCE`)."""
    if cluster_resources.get(TRIAL_DRIVER_RESOURCE, 0) >= 1:
        return {TRIAL_DRIVER_RESOURCE: 1}
    return {"CPU": 0.01}


#: What starting Ray changed in this process (pipelines.execution.runtime.session), for :func:`undo_settings`.
UNDO: list[Any] = []


#: Where the private credentials folder goes: memory-backed where the machine has it (else the temp dir).
CREDENTIALS_PARENT = "/dev/shm"
_CREDENTIALS_PREFIX = "dmlrc-aws-"


def _credentials_parent() -> str:
    shm = CREDENTIALS_PARENT
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_credentials(parent: str) -> list[str]:
    """Delete the credentials folders (``dmlrc-aws-<pid>-*``) in ``parent`` that belong to this user and whose
    driver process is gone: a driver killed by SIGKILL (or the OOM killer) cannot run ``session.stop_ray``, so its
    folder outlives it until the next sweep of the same user starts here.  Returns the folders removed."""
    removed: list[str] = []
    pattern = re.compile(re.escape(_CREDENTIALS_PREFIX) + r"(\d+)-")
    if not hasattr(os, "getuid"):  # no owner to compare with (Windows): leave every folder alone
        return removed
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        path = os.path.join(parent, name)
        try:
            mine = os.lstat(path).st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def hide_credentials() -> None:
    """Move the AWS secrets out of ``os.environ`` into a private shared-credentials file (module docstring)."""
    secrets = {k: os.environ[k] for k in AWS_SECRET_ENV if os.environ.get(k)}
    if not secrets:
        return
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    parent = _credentials_parent()
    remove_stale_credentials(parent)
    # the driver's pid in the name: a later sweep can tell a dead driver's folder from a live one
    folder = tempfile.mkdtemp(prefix=f"{_CREDENTIALS_PREFIX}{os.getpid()}-", dir=parent)
    path = os.path.join(folder, "credentials")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"[{profile}]\n" + "".join(f"{_CREDENTIAL_FILE_KEYS[k]} = {v}\n" for k, v in secrets.items()))
    previous_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
    for k in secrets:
        del os.environ[k]
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = path

    def undo() -> None:
        os.environ.update(secrets)
        if previous_file is None:
            os.environ.pop("AWS_SHARED_CREDENTIALS_FILE", None)
        else:
            os.environ["AWS_SHARED_CREDENTIALS_FILE"] = previous_file
        shutil.rmtree(folder, ignore_errors=True)

    UNDO.append(undo)


#: Ray's ``worker_process_setup_hook`` for every job ``session.init_ray`` starts (imported by each worker).
WORKER_SETUP_HOOK = "pipelines.execution.runtime.worker_setup.setup_worker"


def apply_ray_env() -> None:
    """:data:`RAY_ENV` into this process's environment, where not set already: before Ray is imported."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)


def undo_settings() -> None:
    """Undo what Ray's start changed in this process (credentials moved to a file, the loopback switch, MLflow
    retries), last change first."""
    while UNDO:
        UNDO.pop()()
