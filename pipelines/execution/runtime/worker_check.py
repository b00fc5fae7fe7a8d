"""The user's code checked where the folds will run: right after Ray starts, one Ray task
(:func:`build_in_worker`, submitted by :func:`pipelines.execution.runtime.session.check_user_code_on_workers`) imports
every loss and the trunk of the sweep and builds each loss at its defaults, in a worker process with the sweep's
``runtime_env``.  A
plugin that imports on the driver but not on the workers (not installed there, a ``py_modules`` entry missing) is
then one :class:`ConfigError` naming the loss or trunk before any trial starts, not a failed fold minutes in.

:func:`check_package_sizes` runs before Ray starts (preflight): a ``working_dir`` or ``py_modules`` folder over Ray's
upload limit, measured by Ray's own packaging rules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dml_core.losses import build_loss
from dml_core.trunks import check_trunk
from pipelines.config import ConfigError, SweepConfig

__all__ = ["check_package_sizes", "build_in_worker"]


def build_in_worker(
    losses: list[tuple[str, dict[str, Any]]], trunk: str, num_classes: int, embedding_dim: int
) -> tuple[str, str] | None:
    """The body of the worker task: ``(field, problem)`` of the first loss or trunk that fails, else ``None``."""
    try:
        check_trunk(trunk)
    except (Exception, SystemExit) as e:  # whatever the plugin raises (or exits with) is reported, not re-raised
        return "model.trunk", " ".join(f"{type(e).__name__}: {e}".split())
    for i, (name, params) in enumerate(losses):
        try:
            build_loss(name, num_classes=num_classes, embedding_dim=embedding_dim, **params)
        except (Exception, SystemExit) as e:
            return f"losses[{i}].name", " ".join(f"{type(e).__name__}: {e}".split())
    return None


def _package_bytes(path: Path, excludes: list[str], working_dir: bool) -> int | None:
    """The bytes Ray would upload for one ``working_dir`` or ``py_modules`` folder: its files that neither the
    config's ``excludes``, Ray's default excludes (``working_dir`` only) nor ``.gitignore`` / ``.rayignore`` files
    leave out, walked by Ray's own packaging code (Ray stores the files uncompressed).  ``None`` where that code is
    not there to ask."""
    try:
        # Ray's packaging module only (nothing starts): the rules must be exactly the ones the upload applies
        from ray._private import ray_constants
        from ray._private.runtime_env import packaging
    except ImportError:
        return None
    patterns = list(excludes)
    if working_dir:
        patterns += ray_constants.get_runtime_env_default_excludes()
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    total = 0

    def add(p: Path) -> None:
        nonlocal total
        if p.is_file():
            total += p.stat().st_size

    try:
        packaging._dir_travel(path, [packaging._get_excludes(path, patterns)], add, include_gitignore=include_gitignore)
    except (AttributeError, TypeError):  # Ray's private packaging API changed: Ray's own check remains
        return None
    return total


def check_package_sizes(cfg: SweepConfig) -> None:
    """A ``working_dir`` or ``py_modules`` folder larger than Ray's upload limit (512 MiB) is refused before Ray
    starts, naming the folder, instead of failing in ``ray.init`` with a traceback."""
    env = cfg.runtime_env
    folders = [("runtime_env.working_dir", env.working_dir, True)] if env.working_dir else []
    folders += [(f"runtime_env.py_modules[{i}]", p, False) for i, p in enumerate(env.py_modules) if Path(p).is_dir()]
    if not folders:
        return
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE  # the limit the upload enforces

    for field, folder, is_working_dir in folders:
        size = _package_bytes(Path(folder), list(env.excludes), is_working_dir)
        if size is not None and size >= GCS_STORAGE_MAX_SIZE:
            raise ConfigError(
                field,
                f"{folder} holds {size / 2**20:.0f} MiB to upload, over Ray's limit of "
                f"{GCS_STORAGE_MAX_SIZE / 2**20:.0f} MiB: leave data and environments out (runtime_env.excludes, "
                ".gitignore or .rayignore) or install the code on the nodes",
            )
