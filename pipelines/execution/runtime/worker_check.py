"""The user's code checked where the folds will run: right after Ray starts, one Ray task
(:func:`build_in_worker`, submitted by :func:`pipelines.execution.runtime.session.check_user_code_on_workers`) imports
every loss and the trunk of the sweep and builds each loss at its defaults, in a worker process with the sweep's
``runtime_env``.  A plugin that imports on the driver but not on the workers (not installed there, a ``py_modules``
entry missing) is then one :class:`ConfigError` naming the loss or trunk before any trial starts, not a failed fold
minutes in."""

from __future__ import annotations

from typing import Any

from dml_core.losses import build_loss
from dml_core.trunks import check_trunk

__all__ = ["build_in_worker"]


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
