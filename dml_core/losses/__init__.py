"""The loss zoo.  Import side effect: every module below registers its losses.

Use :func:`build_loss` / :func:`list_losses` / :func:`loss_info`; see ``docs/losses.md``.
"""

from dml_core.losses.registry import (  # noqa: F401
    MLRC_BATCH,
    MLRC_MODEL,
    BatchSpec,
    LossInfo,
    ModelRecipe,
    build_loss,
    list_losses,
    list_wrappers,
    loss_info,
    register,
    register_wrapper,
)

# Loss modules (each registers itself on import).  Keep this list in sync with docs/losses.md.
import importlib as _importlib

for _mod in (
    "baselines",  # reality-check baselines wrapping pytorch-metric-learning
    "rsw",
    "multi_proxy_anchor",
    "group_loss",
    "sec",
    "proxynca",
):
    try:
        _importlib.import_module(f"dml_core.losses.{_mod}")
    except ModuleNotFoundError as _e:  # a module not written yet; remove once all exist
        if _e.name != f"dml_core.losses.{_mod}":
            raise
