"""The loss zoo.  Import side effect: every module below registers its losses.

Use :func:`build_loss` / :func:`list_losses` / :func:`loss_info`; see ``docs/losses.md``.  Losses from outside
this package (an import path ``"module:attribute"`` or an entry point in the group ``dml_reality_check.losses``)
resolve through the same functions; :func:`loss_metadata` declares their metadata (``docs/plugins.md``).
"""

from dml_core.losses.registry import (  # noqa: F401
    ENTRY_POINT_GROUP,
    MLRC_BATCH,
    MLRC_LOSS_WEIGHT_DECAY,
    MLRC_MODEL,
    MLRC_PAPER,
    BatchSpec,
    LossInfo,
    LossMetadata,
    LossPluginError,
    ModelRecipe,
    PluginDistribution,
    build_loss,
    check_plugin_losses,
    list_losses,
    list_plugin_losses,
    list_wrappers,
    loss_info,
    loss_metadata,
    plugin_space,
    register,
    register_wrapper,
    registered_info,
    resolve_loss,
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
