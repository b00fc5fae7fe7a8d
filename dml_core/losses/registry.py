"""Loss registry: the built-in losses (:data:`LOSS_REGISTRY`, a :class:`dml_core.registry.Registry` like the trunks'
and the dataset kinds'), the wrappers, the decorators that fill them, per-loss metadata.

Every loss module registers its classes with :func:`register`; names become losses in :mod:`dml_core.losses.resolve`
(``build_loss``, ``loss_info``, ...), which loads the zoo.  The metadata tells the
training loop and the sweep pipeline what the loss needs, so that nothing downstream
special-cases a loss by name:

* ``learnable``      – whether the loss owns parameters (proxies, class weights, margins).
* ``own_optimizer``  – whether those parameters get their own optimiser whose learning rate
                       is the searched hyperparameter ``loss_lr`` ("fast proxies").
* ``batch``          – the batch composition the paper uses (classes × samples per class,
                       anchors per class for Group Loss).
* ``model``          – the model recipe of the paper (pooling, LayerNorm); the pipeline
                       applies it unless the user's config overrides it.
* ``loss_weight_decay`` – weight decay of the loss-parameter optimiser.

:func:`build_loss` records the registry name on the module it returns (``module.registry_name``), so
:func:`dml_core.training.loop.train_fold` finds the loss's own ``loss_weight_decay`` without the caller
passing it: a direct caller trains exactly as the sweep does.

Losses from outside this package (``docs/plugins.md``, "Losses"): a name that is not built in resolves

* as an import path ``"module:attribute"`` (``"mylab.losses:CircleLoss"``), or
* as the name of an entry point in the group ``dml_reality_check.losses`` of an installed distribution,
  looked up only when the name is not built in (built-ins always win).

Either names a loss factory or ``nn.Module`` class called like the built-ins; :func:`loss_metadata` attaches the
same metadata a built-in gets from :func:`register` (without registering anything).  One function,
:func:`resolve_loss`, turns every name into a :class:`LossInfo`; :func:`loss_info`, :func:`build_loss` and
:func:`registered_info` all go through it, so a worker that rebuilds a loss from ``module.registry_name`` resolves it
exactly as the process that built it first.

Name syntax: a prefix before the first ``:`` that is a registered wrapper is a wrapper (``"sec:triplet"``,
``"sec:mylab.losses:CircleLoss"``, ``"l2_reg:circle"``); otherwise a name containing ``:`` is an import path.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# The plugin machinery shared with the trunks; PluginDistribution and LossPluginError are re-exported here and by
# dml_core.losses.
from dml_core.plugins import LossPluginError, PluginDistribution

# The protocol's shared recipe lives in dml_core.protocol (imported by dml_core.training.loop too); re-exported here.
from dml_core.protocol import (
    MLRC_BATCH,
    MLRC_LOSS_WEIGHT_DECAY,
    MLRC_MODEL,
    MLRC_PAPER,
    BatchSpec,
    ModelRecipe,
)
from dml_core.registry import Registry

__all__ = [
    "BatchSpec",
    "ModelRecipe",
    "LossInfo",
    "LossMetadata",
    "LossPluginError",
    "PluginDistribution",
    "ENTRY_POINT_GROUP",
    "LOSS_REGISTRY",
    "MLRC_PAPER",
    "MLRC_BATCH",
    "MLRC_MODEL",
    "register",
    "register_wrapper",
    "loss_metadata",
    "MLRC_LOSS_WEIGHT_DECAY",
]

#: Entry-point group through which an installed distribution offers losses (``docs/plugins.md``).
ENTRY_POINT_GROUP = "dml_reality_check.losses"
#: Where :func:`loss_metadata` stores its :class:`LossMetadata` (in the object's own ``__dict__``).
_METADATA_ATTR = "__dml_loss_metadata__"
#: Keys of a shipped search space, as in ``tune_spaces/*.yaml``.
_SPACE_KEYS = ("loss", "space", "fixed", "paper_defaults")


@dataclass(frozen=True)
class LossInfo:
    name: str
    factory: Callable[..., torch.nn.Module]
    paper: str
    #: ``None``: not declared (a plugin loss without ``learnable=``); :func:`registered_info` answers it for a built
    #: module from its parameters.  ``train_fold`` optimises every trainable loss parameter whatever this says.
    learnable: bool | None = False
    #: ``None`` follows ``learnable`` once that is known.
    own_optimizer: bool | None = False
    batch: BatchSpec = field(default_factory=BatchSpec)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    description: str = ""
    #: Weight decay of the loss-parameter optimiser.  MLRC: RMSprop with weight decay 1e-4 for
    #: proxies/class weights, but none for Margin's beta (MLRC's "*_no_weight_decay" runs).
    loss_weight_decay: float = MLRC_LOSS_WEIGHT_DECAY
    #: ``"builtin"`` (registered in this package), ``"entry_point"`` or ``"import_path"``.
    origin: str = "builtin"
    #: The distribution providing a plugin loss; ``None`` for built-ins and for import paths outside any
    #: installed distribution.
    distribution: PluginDistribution | None = None


@dataclass(frozen=True)
class LossMetadata:
    """What :func:`loss_metadata` attaches to a plugin loss (the fields :func:`register` gives a built-in)."""

    paper: str = ""
    learnable: bool | None = None
    own_optimizer: bool | None = None
    batch: BatchSpec = MLRC_BATCH
    model: ModelRecipe = MLRC_MODEL
    loss_weight_decay: float = MLRC_LOSS_WEIGHT_DECAY
    description: str = ""
    #: A search space (mapping with the keys of ``tune_spaces/*.yaml``) or ``"package:relative/file.yaml"``.
    space: dict[str, Any] | str | None = None


#: The built-in losses (name -> :class:`LossInfo`, filled by :func:`register`) and the entry points of
#: :data:`ENTRY_POINT_GROUP`.
LOSS_REGISTRY: Registry[LossInfo] = Registry("loss", ENTRY_POINT_GROUP, LossPluginError)
#: The built-ins as a read-only mapping (``LOSS_REGISTRY.builtins``).
_REGISTRY = LOSS_REGISTRY.builtins
_WRAPPERS: dict[str, Callable[..., torch.nn.Module]] = {}


def register(
    name: str,
    *,
    paper: str,
    learnable: bool = False,
    own_optimizer: bool | None = None,
    batch: BatchSpec | None = None,
    model: ModelRecipe | None = None,
    description: str = "",
    loss_weight_decay: float = MLRC_LOSS_WEIGHT_DECAY,
):
    """Class decorator adding a loss (an ``nn.Module`` class, a :class:`~dml_core.plugins.LossFactory`) to the
    registry under ``name``, the one place the name is written: the decorator sets the class's ``name`` attribute
    (which its error messages use), so a class must not set its own.

    The class is called as ``factory(num_classes=..., embedding_dim=..., **params)``.
    """

    def deco(factory):
        if name in LOSS_REGISTRY:
            raise ValueError(f"loss {name!r} registered twice")
        if not isinstance(factory, type) or not issubclass(factory, torch.nn.Module):
            raise TypeError(f"register({name!r}) decorates an nn.Module class, got {factory!r}")
        if "name" in vars(factory):
            raise ValueError(f"loss {name!r}: {factory.__name__} sets its own name; register() gives it")
        factory.name = name
        info = LossInfo(
            name=name,
            factory=factory,
            paper=paper,
            learnable=learnable,
            own_optimizer=learnable if own_optimizer is None else own_optimizer,
            batch=batch or BatchSpec(),
            model=model or ModelRecipe(),
            description=description,
            loss_weight_decay=loss_weight_decay,
        )
        LOSS_REGISTRY.register(name, info)
        return factory

    return deco


def register_wrapper(prefix: str):
    """Register a wrapper usable as ``"<prefix>:<base>"`` (e.g. ``sec:triplet``).

    The wrapper factory is called as ``wrapper(base_module, **wrapper_params)``.
    """

    def deco(factory):
        _WRAPPERS[prefix] = factory
        return factory

    return deco


# --------------------------------------------------------------------------------------------------- plugin metadata
def _check_space_reference(space: Any) -> None:
    if space is None or isinstance(space, dict):
        return
    if not isinstance(space, str):
        raise TypeError(
            f"loss_metadata: space must be a mapping or 'package:relative/file.yaml', got {type(space).__name__}"
        )
    package, sep, rel = space.partition(":")
    parts = rel.split("/")
    if (
        not sep
        or not package
        or not all(p.isidentifier() for p in package.split("."))
        or not rel
        or rel.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(
            f"loss_metadata: space {space!r} is not 'package:relative/file.yaml' (a file inside an "
            "importable package, read with importlib.resources)"
        )


def loss_metadata(
    *,
    paper: str = "",
    learnable: bool | None = None,
    own_optimizer: bool | None = None,
    batch: BatchSpec | None = None,
    model: ModelRecipe | None = None,
    loss_weight_decay: float = MLRC_LOSS_WEIGHT_DECAY,
    description: str = "",
    space: dict[str, Any] | str | None = None,
):
    """Decorator for a plugin loss (factory function or ``nn.Module`` class): attach the metadata that
    :func:`register` gives a built-in.  It registers nothing; the loss is found by its import path or entry point.

    Every field is optional: ``learnable=None`` is decided from the built module's parameters, ``own_optimizer``
    follows ``learnable``, ``batch``/``model`` default to MLRC's (:data:`MLRC_BATCH`, :data:`MLRC_MODEL`),
    ``paper`` to the object's ``module:qualname``.  ``space`` is the loss's search space: a mapping with the keys
    of ``tune_spaces/*.yaml`` (``space``, ``fixed``, ``paper_defaults``) or a package resource
    ``"package:relative/file.yaml"`` (see :func:`plugin_space`).  The metadata belongs to the decorated object
    only; a subclass of a decorated class declares its own.
    """
    for key, value in (("paper", paper), ("description", description)):
        if not isinstance(value, str):
            raise TypeError(f"loss_metadata: {key} must be a string, got {type(value).__name__}")
    for key, switch in (("learnable", learnable), ("own_optimizer", own_optimizer)):
        if switch is not None and not isinstance(switch, bool):
            raise TypeError(f"loss_metadata: {key} must be true, false or None, got {switch!r}")
    if batch is not None and not isinstance(batch, BatchSpec):
        raise TypeError(f"loss_metadata: batch must be a dml_core.losses.BatchSpec, got {type(batch).__name__}")
    if model is not None and not isinstance(model, ModelRecipe):
        raise TypeError(f"loss_metadata: model must be a dml_core.losses.ModelRecipe, got {type(model).__name__}")
    if (
        isinstance(loss_weight_decay, bool)
        or not isinstance(loss_weight_decay, (int, float))
        or not math.isfinite(loss_weight_decay)
        or loss_weight_decay < 0
    ):
        raise ValueError(f"loss_metadata: loss_weight_decay must be a finite number >= 0, got {loss_weight_decay!r}")
    _check_space_reference(space)
    meta = LossMetadata(
        paper=paper,
        learnable=learnable,
        own_optimizer=own_optimizer,
        batch=batch if batch is not None else MLRC_BATCH,
        model=model if model is not None else MLRC_MODEL,
        loss_weight_decay=float(loss_weight_decay),
        description=description,
        space=copy.deepcopy(space),
    )

    def deco(obj):
        if not callable(obj):
            raise TypeError(f"loss_metadata: decorates a loss factory or nn.Module class, got {type(obj).__name__}")
        setattr(obj, _METADATA_ATTR, meta)
        return obj

    return deco


def _own_metadata(obj: Any) -> LossMetadata | None:
    """The object's own :class:`LossMetadata` (not one inherited from a decorated base class)."""
    own = getattr(obj, "__dict__", None)
    meta = own.get(_METADATA_ATTR) if own is not None else None
    return meta if isinstance(meta, LossMetadata) else None
