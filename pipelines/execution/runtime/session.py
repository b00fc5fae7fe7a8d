"""Ray for a ``dmlrc`` command: start a local Ray or join a cluster, check what only a running Ray can answer, stop.

This module imports Ray, so it is imported once a command's own checks have passed (a sweep's config, its storage,
its tracking store: :mod:`pipelines.execution.runtime.environment`), and it sets :data:`environment.RAY_ENV` first: Ray
reads some of those settings when it is imported.

* **Joining a cluster** (``--address``) first asks it once (:func:`check_cluster_answers`): nothing listening and a
  cluster that refuses this driver's token are two different one-line errors.
* **Every worker** of the job runs :data:`environment.WORKER_SETUP_HOOK`, which scopes Ray's State API to the
  worker's own cluster and lets a worker Ray stops with SIGTERM exit quietly
  (``pipelines/execution/runtime/worker_setup.py``).
* **Loopback only.**  A Ray the sweep starts itself binds GCS, raylet, object manager, runtime-env agent, driver
  and workers to 127.0.0.1: Ray's own switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (meant for laptops) makes
  it pick the loopback address as the node IP, and every Ray server then listens on that address only.
  (``ray.init(_node_ip_address="127.0.0.1")`` does not do it: Ray replaces a loopback address by the machine's
  routable one.)  The folds' gloo connections use the loopback interface (``GLOO_SOCKET_IFNAME=lo``).  Connecting
  to a cluster (``--address``) leaves the cluster's own settings alone.  Not covered: the rendezvous store of each
  fold's ``torch.distributed`` group (a ``TCPStore`` on Train worker 0, set up by Ray Train) listens on all
  interfaces — torch's TCPStore has no bind-address option, only a pre-bound socket that Ray Train does not pass.
* **A Ray process's native abort** (``Mutex corrupt``, ``*** SIGABRT received``, ``Fatal Python error: Aborted``),
  forwarded to this terminal, is one ``warning:`` line naming the process and the log file that keeps its report
  (``pipelines/execution/runtime/output.py``).
* **Credentials** are moved out of the environment while Ray runs and put back by :func:`stop_ray`
  (:func:`pipelines.execution.runtime.environment.hide_credentials`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import warnings
from typing import Any

from dml_core.losses import loss_info
from dml_core.trunks import resolve_trunk
from pipelines.config import ConfigError, SweepConfig, redact_uri
from pipelines.config.spaces import LOSS_LR
from pipelines.execution.runtime.environment import (
    RAY_ENV,
    S3_ENV,
    TRIAL_DRIVER_RESOURCE,
    TRIAL_DRIVER_SLOTS,
    UNDO,
    WORKER_SETUP_HOOK,
    apply_ray_env,
    hide_credentials,
    s3_compat_env,
    undo_settings,
    worker_env,
)
from pipelines.execution.runtime.interrupts import install_startup_handlers
from pipelines.execution.runtime.resources import check_cluster_resources, check_node_resources, default_num_cpus
from pipelines.execution.runtime.worker_check import build_in_worker
from pipelines.tracking.outage import apply_retry_env

apply_ray_env()  # Ray reads some of these settings as it is imported: before the imports below

import ray  # noqa: E402 - after apply_ray_env, as said above
from ray._private import ray_constants, services  # noqa: E402 - as above
from ray._private.authentication import authentication_token_setup as token_setup  # noqa: E402 - as above
from ray._raylet import GcsClient  # type: ignore[attr-defined]  # noqa: E402 - as above; not in _raylet.pyi
from ray.exceptions import AuthenticationError  # noqa: E402 - as above

from pipelines.execution.runtime.output import condense_aborts  # noqa: E402 - imports Ray: as above

__all__ = [
    "init_ray",
    "start_ray",
    "start_sweep_ray",
    "stop_ray",
    "check_cluster_answers",
    "warn_multi_node",
    "cluster_resources",
    "node_resources",
    "check_user_code_on_workers",
]

#: Ray's switch that makes a local node use the loopback address (ray/_private/ray_constants.py).
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

#: What a driver needs to join a cluster that has token authentication (Ray's ``RAY_AUTH_MODE=token``).  Each form is
#: spelt out: RAY_AUTH_TOKEN_PATH holds a path (Ray opens it as given: no ``~``), never the token itself; and
#: ``ray get-auth-token`` prints the token of the shell it runs in (RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH, then
#: ~/.ray/auth_token), the cluster's only with the head's settings.  README.md's cluster steps use the same forms.
_TOKEN_HELP = (
    "the cluster's token: RAY_AUTH_TOKEN_PATH=<full path of a file holding it>, RAY_AUTH_TOKEN=<the token> or the "
    "file ~/.ray/auth_token (`ray get-auth-token` with the head's settings prints it; README.md, Running on a cluster)"
)


def _loopback_only() -> None:
    """Make the local Ray about to start use 127.0.0.1 as its node address (module docstring)."""
    previous = os.environ.get(_LOOPBACK_SWITCH)
    os.environ[_LOOPBACK_SWITCH] = "0"
    constant = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False

    def undo() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = constant
        if previous is None:
            os.environ.pop(_LOOPBACK_SWITCH, None)
        else:
            os.environ[_LOOPBACK_SWITCH] = previous

    UNDO.append(undo)


def stop_ray(started: bool) -> None:
    """Shut down the Ray :func:`start_ray` started (if it did) and undo its changes to this process."""
    try:
        if started:
            ray.shutdown()
    finally:
        undo_settings()


def start_ray(cfg: SweepConfig, address: str | None) -> bool:
    """:func:`init_ray` for a sweep: a local Ray gets ``resources.num_cpus`` logical CPUs (default
    :func:`default_num_cpus`); this process and every worker get MLflow HTTP retries that outlast
    ``tracking.outage_timeout_s`` (:mod:`pipelines.tracking.outage`)."""
    retries = apply_retry_env(cfg.tracking.outage_timeout_s, UNDO)
    return init_ray(
        address,
        num_cpus=cfg.resources.num_cpus or default_num_cpus(cfg),
        env=retries,
        user_env=cfg.runtime_env.ray_runtime_env(),
    )


def start_sweep_ray(cfg: SweepConfig, address: str | None, min_train_classes: int) -> bool:
    """Start (or join) Ray for a sweep and check what only Ray can tell — the cluster answers and admits this driver
    (in :func:`init_ray`), its resources fit one fold, the user's code imports on a worker — before the tracking
    store or the sweep's folder is created, so that a config error leaves nothing behind.  Returns whether Ray was
    started here; on any failure Ray is stopped and the error goes on."""
    started = False
    try:
        started = start_ray(cfg, address)
        install_startup_handlers()  # Ray's driver installs a native SIGTERM handler: ours again, until stop_on_sigint
        # before the sweep's config or any run, before any trial
        check_cluster_resources(cfg, cluster_resources())
        check_node_resources(cfg, node_resources())
        check_user_code_on_workers(cfg, min_train_classes)
    except BaseException:
        stop_ray(started)  # also undoes what start_ray changed in this process (credentials, loopback, retries)
        raise
    return started


#: How long the check of the user's code may wait for a worker (Ray installs a runtime_env's pip packages on first
#: use).
USER_CODE_TIMEOUT_S = 600.0


def check_user_code_on_workers(cfg: SweepConfig, num_classes: int) -> None:
    """Run :func:`build_in_worker` as one Ray task (call after ``ray.init``).  Only plugin losses and trunks need it:
    built-in ones ship with this package."""
    losses = [
        (ls.name, {k: v for k, v in {**ls.search_space.defaults(), **ls.params}.items() if k != LOSS_LR})
        for ls in cfg.losses
    ]
    plugin = [loss_info(name).origin != "builtin" for name, _ in losses]
    trunk_plugin = resolve_trunk(cfg.model.trunk).kind in ("import", "entry_point")
    if not any(plugin) and not trunk_plugin:
        return
    # Built-in losses are passed too (cheap), so that a failing index names the config's own entry.
    task = ray.remote(num_cpus=0, max_retries=0)(build_in_worker)
    ref = task.remote(losses, cfg.model.trunk, num_classes, cfg.model.embedding_dim)
    try:
        found = ray.get(ref, timeout=USER_CODE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ConfigError(
            "runtime_env",
            f"no Ray worker could import the sweep's code within {USER_CODE_TIMEOUT_S:.0f} s "
            "(runtime_env set-up still running or failing)",
        ) from None
    except ray.exceptions.RuntimeEnvSetupError as e:
        raise ConfigError(
            "runtime_env", "Ray could not set it up on a worker: " + " ".join(str(e).split())[-500:]
        ) from None
    if found is not None:
        field, problem = found
        raise ConfigError(
            field,
            f"imports on the driver but not on the Ray workers: {problem} (ship it with "
            "runtime_env: py_modules / working_dir / pip, or install it on every node)",
        )


def _no_cluster(address: str, error: BaseException | str) -> str:
    return f"no Ray cluster answers at {redact_uri(address)} ({' '.join(str(error).split())[:300]})"


def _auth_problem(address: str, detail: str) -> str:
    """One line for a cluster that answered and refused this driver (``detail``: Ray's reason)."""
    reason = " ".join(str(detail).split()).removeprefix("RPC error: ").rstrip(".")
    # Ray's reason ends with RAY_AUTH_TOKEN_PATH's value when it names no readable file ("…cannot be opened or is
    # empty: <value>"): the token itself, where it was set there in place of a path.
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    if token_path:
        reason = reason.replace(f": {token_path}", ": $RAY_AUTH_TOKEN_PATH")
    reason = reason[:200]
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
    would (the same address resolution, the same token rules), answers at once.  A ``ray://`` address (Ray Client)
    is asked whether anything listens at its port (Ray Client would wait 30 s for a closed one); what answers there
    is left to ``ray.init``, as are addresses Ray cannot resolve."""
    if address.startswith("ray://"):
        host, _, port = address[len("ray://") :].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise ConfigError(where, _no_cluster(address, getattr(e, "strerror", None) or e)) from None
        return
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
    apply_ray_env()  # where Ray was imported before this module (the settings read at import are then late)
    s3_compat_env()
    hide_credentials()
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
        _join_cluster(address, address_field, kwargs)
    else:
        _start_local(num_cpus, kwargs)
    condense_aborts()  # a Ray process's native abort report: one line in this terminal (output.py)
    for name in ("ray.tune", "ray.train", "ray.air", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return True


def _join_cluster(address: str, address_field: str, kwargs: dict[str, Any]) -> None:
    """``ray.init`` on a running cluster; one that does not answer, or refuses this driver, is one config error."""
    where = address_field if os.environ.get("RAY_ADDRESS") != address else "RAY_ADDRESS"
    check_cluster_answers(address, where)
    try:
        with warnings.catch_warnings():
            # Ray Client warns about its timeout (and a web page) before raising it: the one line below says it
            warnings.filterwarnings("ignore", message="Ray Client connection timed out", category=UserWarning)
            ray.init(address=address, **kwargs)
    except ray.exceptions.AuthenticationError as e:  # Ray Client (ray://) refused, or no token here
        raise ConfigError(where, _auth_problem(address, e.message)) from None
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as e:
        raise ConfigError(where, _no_cluster(address, e)) from None


def _token_folder_owner_only() -> None:
    """A local Ray with token authentication (Ray's default for a new cluster) writes its token to
    ``~/.ray/auth_token`` when there is none, with this process's umask: commonly readable by every user of the
    machine, who could then join this user's Ray and run code in it.  Create ``~/.ray`` owner-only where Ray is
    about to create it; :func:`_token_file_owner_only` narrows the file itself once Ray has written it."""
    folder = token_setup._get_default_token_path().parent
    with contextlib.suppress(OSError):  # no home folder: Ray's own error, if any, is the one to show
        folder.mkdir(mode=0o700, exist_ok=False)


def _token_file_owner_only() -> None:
    """Make this user's ``~/.ray/auth_token`` readable by its owner only (:func:`_token_folder_owner_only`)."""
    token = token_setup._get_default_token_path()
    with contextlib.suppress(OSError):  # no token (authentication disabled), or not ours to change
        st = token.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            token.chmod(0o600)


def _start_local(num_cpus: int, kwargs: dict[str, Any]) -> None:
    """``ray.init`` of a Ray on this machine: the trial-driver slots, gloo over loopback, no preemption watcher, its
    authentication token readable by this user only."""
    # One machine cannot be preempted node by node: skip Train's per-run preemption-watcher actor.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    kwargs["runtime_env"]["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    kwargs["resources"] = {TRIAL_DRIVER_RESOURCE: TRIAL_DRIVER_SLOTS}
    if (
        sys.platform.startswith("linux")
        and os.path.exists("/sys/class/net/lo")
        and "GLOO_SOCKET_IFNAME" not in os.environ
    ):
        # The folds' gloo (CPU DDP) connections between workers of one machine: over loopback only.
        kwargs["runtime_env"]["env_vars"]["GLOO_SOCKET_IFNAME"] = "lo"
    _token_folder_owner_only()
    for attempt in range(3):
        try:
            ray.init(num_cpus=num_cpus, **kwargs)
            _token_file_owner_only()
            return
        except Exception as e:  # only Ray's start-up timeout is retried
            # Ray waits a fixed 30 s for its raylet to register; a saturated machine can miss that.
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            ray.shutdown()
            time.sleep(5)


def warn_multi_node(cfg: SweepConfig, uri: str, out) -> None:
    """On a multi-node cluster, local storage and a sqlite/file tracking store only work through a shared mount."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    if TRIAL_DRIVER_RESOURCE not in ray.cluster_resources():
        print(
            f"note: no node declares the custom resource {TRIAL_DRIVER_RESOURCE!r}, so trial drivers (0.01 CPU each) "
            "may land on any node, lose a fold slot there, and die with it; declare it on the head "
            f"(ray start --head --resources '{{\"{TRIAL_DRIVER_RESOURCE}\": {TRIAL_DRIVER_SLOTS}}}')"
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


def cluster_resources() -> dict[str, float]:
    """The logical resources of the Ray this driver runs on (``ray.cluster_resources``)."""
    return ray.cluster_resources()


def node_resources() -> list[dict[str, float]]:
    """The logical resources of each live node of the Ray this driver runs on (``ray.nodes``)."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
