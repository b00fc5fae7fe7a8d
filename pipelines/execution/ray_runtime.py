"""Ray start-up and the infrastructure checks a sweep makes before Ray starts.

Everything here runs on the driver: the environment Ray and its workers get (:data:`RAY_ENV`, :data:`S3_ENV`),
the reachability checks for the sweep's storage and tracking store (each fails with a one-line
``config error: <field>: …`` before anything expensive starts), :func:`start_ray` / :func:`stop_ray`, and the
check of the cluster's resources against the config (:func:`check_cluster_resources`).  Joining a cluster
(``--address``) first asks it once (:func:`check_cluster_answers`): nothing listening and a cluster that refuses this
driver's token are two different one-line errors.  Every worker of the job runs :data:`WORKER_SETUP_HOOK`, which
scopes Ray's State API to the worker's own cluster and lets a worker Ray stops with SIGTERM exit quietly
(``pipelines/execution/worker_setup.py``).

Security:

* **Loopback only.**  A Ray the sweep starts itself binds GCS, raylet, object manager, runtime-env agent, driver
  and workers to 127.0.0.1: Ray's own switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (meant for laptops) makes
  it pick the loopback address as the node IP, and every Ray server then listens on that address only.
  (``ray.init(_node_ip_address="127.0.0.1")`` does not do it: Ray replaces a loopback address by the machine's
  routable one.)  The folds' gloo connections use the loopback interface (``GLOO_SOCKET_IFNAME=lo``).  Connecting
  to a cluster (``--address``) leaves the cluster's own settings alone.  Not covered: the rendezvous store of each
  fold's ``torch.distributed`` group (a ``TCPStore`` on Train worker 0, set up by Ray Train) listens on all
  interfaces — torch's TCPStore has no bind-address option, only a pre-bound socket that Ray Train does not pass.
* **No credentials in Ray's runtime_env.**  Ray Tune copies ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN`` and ``AWS_SECURITY_TOKEN`` from the driver's environment into every trainable's
  ``runtime_env`` (``ray/tune/execution/class_cache.py``, ``ENV_VARS_TO_PROPAGATE``; Ray 2.60 has no switch
  for it), and Ray's runtime-env agent logs each runtime_env in plain text under the session directory.  For the
  duration of the sweep :func:`start_ray` therefore moves those variables out of the environment into a private
  AWS shared-credentials file (mode 0600 in a 0700 directory, on the memory-backed ``/dev/shm`` where there is
  one) named by ``AWS_SHARED_CREDENTIALS_FILE`` — the SDKs' standard second source, read by boto3 (MLflow) and by
  pyarrow's AWS SDK (Ray storage) alike — and :func:`stop_ray` puts them back and deletes the file.  A driver
  killed outright (SIGKILL, the OOM killer) cannot delete it: the folder carries the driver's pid, and the next
  sweep of the same user on that machine deletes the folders of drivers that are gone
  (:func:`remove_stale_credentials`).  Workers of a
  local Ray inherit the driver's environment (so the file's path); on a cluster the nodes use their own
  environment or instance role: credentials are never shipped through Ray.
* **No passwords printed.**  :func:`redact_uri` turns ``scheme://user:password@host`` into
  ``scheme://user:***@host`` for every message.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Any
from urllib.parse import unquote

from dml_core.storage import split_s3_uri
from pipelines.config import ConfigError, SweepConfig, redact_uri
from pipelines.execution.fold import worker_env
from pipelines.execution.resources import WORKER_GIB, memory_gib
from pipelines.tracking.outage import apply_retry_env
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
    "default_num_cpus",
    "init_ray",
    "check_cluster_answers",
    "WORKER_SETUP_HOOK",
    "start_ray",
    "stop_ray",
    "warn_multi_node",
    "redact_uri",
    "scrub",
    "TRIAL_DRIVER_RESOURCE",
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
    # Ctrl-C is the sweep's (pipelines.execution.interrupts): Tune's handler would end only the current Tuner, quietly,
    # and let the sweep go on with the next one.
    "TUNE_DISABLE_SIGINT_HANDLER": "1",
    # the driver downloads fold models to register them: no progress bar per artifact in the sweep's output
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
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
#: Ray's switch that makes a local node use the loopback address (ray/_private/ray_constants.py).
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

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


def default_num_cpus(cfg: SweepConfig) -> int:
    """Logical CPUs of an embedded local Ray: enough for every fold of ``max_concurrent_trials`` trials at once (a
    tiny model oversubscribes cores happily) — but no more fold workers than this machine's memory holds (about
    ``WORKER_GIB`` each): beyond that, folds wait in Ray's queue instead of swapping the machine to a halt."""
    r = cfg.resources
    need = r.max_concurrent_trials * cfg.protocol.folds * r.workers_per_fold * r.cpus_per_worker
    fits = max(r.workers_per_fold, math.floor(0.8 * memory_gib() / WORKER_GIB)) * r.cpus_per_worker
    return int(max(os.cpu_count() or 1, math.ceil(min(need, fits)) + 1))


#: The custom resource that marks the node(s) where trial drivers (Tune's trial actors, 0 CPU of real work each)
#: belong: the node the sweep is driven from, which is not preemptible (Ray's fault-tolerance advice: keep driver
#: functions on safe nodes, chosen with a custom resource).  A Ray the sweep starts declares it; on a cluster the head
#: declares it (``ray start --head --resources '{"dmlrc_trial_driver": 10000}'``, infra/ray/).  Without it a trial
#: reserves 0.01 CPU on any node — which takes a whole fold slot out of a node whose CPUs are all fold slots, and
#: puts the trial on a node that may be lost with its folds.
TRIAL_DRIVER_RESOURCE = "dmlrc_trial_driver"
_TRIAL_DRIVER_SLOTS = 10_000  # each trial takes 1: no limit in practice (Tune's max_concurrent_trials limits trials)


def trial_bundle(cluster_resources: dict[str, float]) -> dict[str, float]:
    """The resources of one trial driver's placement-group bundle (see :data:`TRIAL_DRIVER_RESOURCE`)."""
    if cluster_resources.get(TRIAL_DRIVER_RESOURCE, 0) >= 1:
        return {TRIAL_DRIVER_RESOURCE: 1}
    return {"CPU": 0.01}


#: What :func:`start_ray` changed in this process, for :func:`stop_ray` to undo.
_UNDO: list[Any] = []


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
    driver process is gone: a driver killed by SIGKILL (or the OOM killer) cannot run :func:`stop_ray`, so its
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


def _hide_credentials() -> None:
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

    _UNDO.append(undo)


def _loopback_only() -> None:
    """Make the local Ray about to start use 127.0.0.1 as its node address (module docstring)."""
    previous = os.environ.get(_LOOPBACK_SWITCH)
    os.environ[_LOOPBACK_SWITCH] = "0"
    from ray._private import ray_constants  # read at import; Ray may have been imported before this call

    constant = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False

    def undo() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = constant
        if previous is None:
            os.environ.pop(_LOOPBACK_SWITCH, None)
        else:
            os.environ[_LOOPBACK_SWITCH] = previous

    _UNDO.append(undo)


def stop_ray(started: bool) -> None:
    """Shut down the Ray :func:`start_ray` started (if it did) and undo its changes to this process."""
    try:
        if started:
            # Ray is imported by init_ray, after RAY_ENV is set (Ray reads it at import): never at module level
            import ray

            ray.shutdown()
    finally:
        while _UNDO:
            _UNDO.pop()()


def start_ray(cfg: SweepConfig, address: str | None) -> bool:
    """:func:`init_ray` for a sweep: a local Ray gets ``resources.num_cpus`` logical CPUs (default
    :func:`default_num_cpus`); this process and every worker get MLflow HTTP retries that outlast
    ``tracking.outage_timeout_s`` (:mod:`pipelines.tracking.outage`)."""
    retries = apply_retry_env(cfg.tracking.outage_timeout_s, _UNDO)
    return init_ray(
        address,
        num_cpus=cfg.resources.num_cpus or default_num_cpus(cfg),
        env=retries,
        user_env=cfg.runtime_env.ray_runtime_env(),
    )


#: Ray's ``worker_process_setup_hook`` for every job :func:`init_ray` starts (module path: imported by each worker).
WORKER_SETUP_HOOK = "pipelines.execution.worker_setup.setup_worker"

#: What a driver needs to join a cluster that has token authentication (Ray's ``RAY_AUTH_MODE=token``).
_TOKEN_HELP = (
    "the cluster's token in RAY_AUTH_TOKEN_PATH (a file), RAY_AUTH_TOKEN or ~/.ray/auth_token "
    "(`ray get-auth-token` on the head prints it)"
)


def _no_cluster(address: str, error: BaseException | str) -> str:
    return f"no Ray cluster answers at {redact_uri(address)} ({' '.join(str(error).split())[:300]})"


def _auth_problem(address: str, detail: str) -> str:
    """One line for a cluster that answered and refused this driver (``detail``: Ray's reason)."""
    reason = " ".join(str(detail).split()).removeprefix("RPC error: ").rstrip(".")[:200]
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        fix = f"set RAY_AUTH_MODE=token and {_TOKEN_HELP}"
    else:
        fix = f"set {_TOKEN_HELP}"
    return (
        f"the Ray cluster at {redact_uri(address)} refused this driver: it requires token authentication "
        f"({reason}); {fix}"
    )


@contextlib.contextmanager
def _native_stderr_muted():
    """File descriptor 2 to /dev/null for the duration (Ray's C++ code writes there, not to ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_cluster_answers(address: str, where: str) -> None:
    """Before ``ray.init`` joins ``address``: one ``config error`` line naming ``where`` when nothing listens there,
    or when a Ray cluster answers there and refuses this driver's authentication (Ray 2.60's token authentication).

    ``ray.init`` itself cannot tell the two apart: it retries (for minutes where nothing listens), printing a warning
    a second, and then raises the same ``ConnectionError`` for both.  Asking the cluster's GCS once, as ``ray.init``
    would (the same address resolution, the same token rules), answers at once.  ``ray://`` addresses (Ray Client)
    and addresses Ray cannot resolve are left to ``ray.init``."""
    if address.startswith("ray://"):
        return
    # Ray is imported after RAY_ENV is set (Ray reads it at import): never at module level (see stop_ray)
    from ray._private import services
    from ray._private.authentication import authentication_token_setup as token_setup
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        gcs = services.canonicalize_bootstrap_address(address)
        host, port = services.parse_address(gcs)
    except Exception:  # no cluster found for "auto", an address Ray reads otherwise: ray.init says why
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(where, _no_cluster(address, e.strerror or e)) from None
    try:
        if address == "auto":  # ray.init takes a token file as "token mode on" for a local cluster found by "auto"
            token_setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        # before any GCS client: one without a token, in token mode, aborts the process
        token_setup.ensure_token_if_auth_enabled(None, create_token_if_missing=False)
        with _native_stderr_muted():  # Ray's C++ client logs a warning line for the refusal we report
            GcsClient(address=gcs)
    except AuthenticationError as e:
        raise ConfigError(where, _auth_problem(address, e.message)) from None
    except Exception as e:  # something listens there, but no GCS answers: one line, the field named
        raise ConfigError(where, _no_cluster(address, e)) from None


def init_ray(
    address: str | None,
    *,
    num_cpus: int,
    env: dict[str, str] | None = None,
    user_env: dict[str, Any] | None = None,
    address_field: str = "--address",
) -> bool:
    """Start (or connect to) Ray for any ``dmlrc`` command (sweep, reeval); returns whether we started it (and so
    must shut it down with :func:`stop_ray`, which is also what undoes the credential and loopback settings below —
    call it either way).  ``num_cpus`` only applies to a Ray started here; ``env`` goes to every worker too.
    ``user_env``: the config's ``runtime_env`` (``py_modules``, ``working_dir``, ``pip``, ``env_vars``,
    ``excludes``), merged into the job's runtime_env so that the user's code reaches every worker process.
    ``address_field``: where the user set ``address`` (the sweep's ``--address``, reeval's ``ray_address``), named by
    the one-line error for a cluster that does not answer or refuses this driver."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    s3_compat_env()
    _hide_credentials()
    # only now: Ray reads the RAY_ENV settings just made when it is imported
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None  # ray.init would join it: no local-Ray settings
    if not address:
        _loopback_only()
    kwargs: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        # Workers, Train controllers and their placement-group cleaners log at INFO/WARNING a lot (the cleaners
        # poll the State API, which needs the dashboard we do not start); our progress lines are prints.
        logging_config=ray.LoggingConfig(log_level=os.environ.get("DMLRC_RAY_LOG_LEVEL", "ERROR")),
        runtime_env={
            **{k: v for k, v in (user_env or {}).items() if k != "env_vars"},
            # every worker's State API asks its own cluster, not another Ray on the same machine, and a worker Ray
            # stops with SIGTERM exits without an "Exception ignored" traceback (worker_setup.py)
            "worker_process_setup_hook": WORKER_SETUP_HOOK,
            "env_vars": {
                **(user_env or {}).get("env_vars", {}),
                **worker_env(),
                **{k: os.environ[k] for k in RAY_ENV},
                **{k: os.environ[k] for k in S3_ENV if k in os.environ},
                **(env or {}),
            },
        },
    )
    if address:
        _join_cluster(ray, address, address_field, kwargs)
    else:
        _start_local(ray, num_cpus, kwargs)
    for name in ("ray.tune", "ray.train", "ray.air", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return True


def _join_cluster(ray: Any, address: str, address_field: str, kwargs: dict[str, Any]) -> None:
    """``ray.init`` on a running cluster; one that does not answer, or refuses this driver, is one config error."""
    where = address_field if os.environ.get("RAY_ADDRESS") != address else "RAY_ADDRESS"
    check_cluster_answers(address, where)
    try:
        ray.init(address=address, **kwargs)
    except ray.exceptions.AuthenticationError as e:  # Ray Client (ray://) refused, or no token here
        raise ConfigError(where, _auth_problem(address, e.message)) from None
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as e:
        raise ConfigError(where, _no_cluster(address, e)) from None


def _start_local(ray: Any, num_cpus: int, kwargs: dict[str, Any]) -> None:
    """``ray.init`` of a Ray on this machine: the trial-driver slots, gloo over loopback, no preemption watcher."""
    # One machine cannot be preempted node by node: skip Train's per-run preemption-watcher actor.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    kwargs["runtime_env"]["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    kwargs["resources"] = {TRIAL_DRIVER_RESOURCE: _TRIAL_DRIVER_SLOTS}
    if (
        sys.platform.startswith("linux")
        and os.path.exists("/sys/class/net/lo")
        and "GLOO_SOCKET_IFNAME" not in os.environ
    ):
        # The folds' gloo (CPU DDP) connections between workers of one machine: over loopback only.
        kwargs["runtime_env"]["env_vars"]["GLOO_SOCKET_IFNAME"] = "lo"
    for attempt in range(3):
        try:
            ray.init(num_cpus=num_cpus, **kwargs)
            return
        except Exception as e:  # only Ray's start-up timeout is retried
            # Ray waits a fixed 30 s for its raylet to register; a saturated machine can miss that.
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            ray.shutdown()
            time.sleep(5)


def warn_multi_node(cfg: SweepConfig, uri: str, out) -> None:
    """On a multi-node cluster, local storage and a sqlite/file tracking store only work through a shared mount."""
    # Ray is imported by init_ray, after RAY_ENV is set (see stop_ray)
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    if TRIAL_DRIVER_RESOURCE not in ray.cluster_resources():
        print(
            f"note: no node declares the custom resource {TRIAL_DRIVER_RESOURCE!r}, so trial drivers (0.01 CPU each) "
            "may land on any node, lose a fold slot there, and die with it; declare it on the head "
            f"(ray start --head --resources '{{\"{TRIAL_DRIVER_RESOURCE}\": {_TRIAL_DRIVER_SLOTS}}}')"
            + (
                ""
                if cfg.resources.trial_retries
                else ", or set resources.trial_retries >= 1 so that Tune reruns a trial whose node died (its folds "
                "resume from their checkpoints)"
            ),
            file=out,
            flush=True,
        )
    if not cfg.storage_is_s3:
        print(
            f"warning: storage: {cfg.ray_storage()} is a local path on a {len(nodes)}-node cluster; it must be a "
            "shared mount (NFS) on every node, else use s3://",
            file=out,
            flush=True,
        )
    if not uri.startswith(("http://", "https://", "postgresql")):
        print(
            f"warning: tracking.uri: {redact_uri(uri)} on a {len(nodes)}-node cluster; "
            "fold workers on other nodes log to MLflow too — use an MLflow server (http(s)://)",
            file=out,
            flush=True,
        )
