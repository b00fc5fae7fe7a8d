"""The loss zoo and how names become losses.

Use :func:`build_loss` / :func:`list_losses` / :func:`loss_info`; see ``docs/losses.md``.  Losses from outside
this package (an import path ``"module:attribute"`` or an entry point in the group ``dml_reality_check.losses``)
resolve through the same functions; :func:`loss_metadata` declares their metadata (``docs/plugins.md``).
:mod:`dml_core.losses.registry` holds the tables and decorators; :mod:`dml_core.losses.resolve` loads the built-in zoo
and resolves names.
"""

from dml_core.losses.registry import (  # noqa: F401 - re-exported: the package's public names
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
    loss_metadata,
    register,
    register_wrapper,
)
from dml_core.losses.resolve import (  # noqa: F401 - re-exported: the package's public names
    UnknownLossError,
    build_loss,
    check_plugin_losses,
    list_losses,
    list_plugin_losses,
    list_wrappers,
    loss_info,
    plugin_space,
    registered_info,
    resolve_loss,
)
