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

# Loss modules: importing each registers its losses.  Keep this list in sync with docs/losses.md.
from dml_core.losses import (  # noqa: E402, F401
    baselines,  # reality-check baselines wrapping pytorch-metric-learning
    group_loss,
    multi_proxy_anchor,
    proxynca,
    rsw,
    sec,
)
