"""Loss registry: ``build_loss(name, ...)`` / ``list_losses()`` and per-loss metadata.

Every loss module registers its classes with :func:`register`.  The metadata tells the
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
:func:`dml_core.train.train_fold` finds the loss's own ``loss_weight_decay`` without the caller
passing it: a direct caller trains exactly as the sweep does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# MLRC's loss-optimiser weight decay (protocol spec §3) lives with TrainConfig's other defaults.
from dml_core.train import MLRC_LOSS_WEIGHT_DECAY

__all__ = [
    "BatchSpec",
    "ModelRecipe",
    "LossInfo",
    "MLRC_PAPER",
    "MLRC_BATCH",
    "MLRC_MODEL",
    "register",
    "build_loss",
    "list_losses",
    "loss_info",
    "MLRC_LOSS_WEIGHT_DECAY",
    "registered_info",
]


@dataclass(frozen=True)
class BatchSpec:
    """Batch composition: ``classes_per_batch`` classes × ``m`` samples each."""

    classes_per_batch: int = 8
    m: int = 4
    #: Group Loss: labelled anchors per class inside the batch (0 = not used).
    anchors_per_class: int = 0


@dataclass(frozen=True)
class ModelRecipe:
    """How the paper builds the embedding model around the trunk."""

    pooling: str = "avg"  # a dml_core.models pooling: "avg" | "max" | "avg+max" | "gem[:P]" | "kmax:K"
    layer_norm: bool = False


#: The protocol every loss is compared under (and the paper whose settings the baselines use).
MLRC_PAPER = "Musgrave, Belongie & Lim, A Metric Learning Reality Check, ECCV 2020"
#: MLRC's batch: PML MPerClassSampler(m=4), batch 32 -> 8 classes x 4 (protocol spec §3).
MLRC_BATCH = BatchSpec(classes_per_batch=8, m=4)
#: MLRC's model: BN-Inception global average pool -> one linear layer, no LayerNorm (protocol spec §3).
MLRC_MODEL = ModelRecipe(pooling="avg", layer_norm=False)


@dataclass(frozen=True)
class LossInfo:
    name: str
    factory: Callable[..., torch.nn.Module]
    paper: str
    learnable: bool = False
    own_optimizer: bool = False
    batch: BatchSpec = field(default_factory=BatchSpec)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    description: str = ""
    #: Weight decay of the loss-parameter optimiser.  MLRC: RMSprop with weight decay 1e-4 for
    #: proxies/class weights, but none for Margin's beta (protocol spec §3, "*_no_weight_decay" runs).
    loss_weight_decay: float = MLRC_LOSS_WEIGHT_DECAY


_REGISTRY: dict[str, LossInfo] = {}
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
    """Class/function decorator adding a loss factory to the registry.

    The factory is called as ``factory(num_classes=..., embedding_dim=..., **params)``.
    """

    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} registered twice")
        _REGISTRY[name] = LossInfo(
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


def _ensure_loaded() -> None:
    # Importing the package runs every module's @register decorators.
    import dml_core.losses  # noqa: F401


def list_losses() -> list[str]:
    """Every registered base-loss name, sorted.  Wrapped names (``sec:<base>``) are built on demand."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def list_wrappers() -> list[str]:
    _ensure_loaded()
    return sorted(_WRAPPERS)


def loss_info(name: str) -> LossInfo:
    """Metadata for ``name``; for ``wrapper:base`` the base loss's metadata."""
    _ensure_loaded()
    base = name.split(":", 1)[1] if ":" in name else name
    if ":" in name:
        prefix = name.split(":", 1)[0]
        if prefix not in _WRAPPERS:
            raise ValueError(f"unknown loss wrapper {prefix!r} in {name!r}; known: {sorted(_WRAPPERS)}")
    if base not in _REGISTRY:
        raise ValueError(f"unknown loss {base!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[base]


def _check_params(where: str, factory: Callable, params: dict[str, Any], reserved: set[str]) -> None:
    """Reject parameters the factory does not take, naming them (before any training starts)."""
    import inspect

    sig = inspect.signature(factory)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {n for n in sig.parameters if n not in reserved}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(
            f"{where}: unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(accepted)) or '(none)'}"
        )


def build_loss(name: str, *, num_classes: int, embedding_dim: int, **params: Any) -> torch.nn.Module:
    """Build a registered loss.  ``loss(embeddings, labels)`` returns a scalar.

    Wrappers: ``"sec:<base>"`` / ``"l2_reg:<base>"``; equivalently, passing a wrapper's
    parameter (``sec_eta=...``, ``l2_reg_eta=...``) to any base loss applies that wrapper.
    Wrapper parameters always carry the wrapper's prefix, so they never collide with a
    base loss's own symbols.
    """
    info = loss_info(name)
    wrappers: list[str] = []
    if ":" in name:
        wrappers.append(name.split(":", 1)[0])
    for prefix in sorted(_WRAPPERS, key=len, reverse=True):
        if prefix not in wrappers and any(k.startswith(prefix + "_") for k in params):
            wrappers.append(prefix)
    wrapper_params: dict[str, dict[str, Any]] = {w: {} for w in wrappers}
    base_params: dict[str, Any] = {}
    for k, v in params.items():
        owner = next((w for w in wrappers if k.startswith(w + "_")), None)
        if owner is None:
            base_params[k] = v
        else:
            wrapper_params[owner][k] = v
    _check_params(f"loss {info.name!r}", info.factory, base_params, {"num_classes", "embedding_dim"})
    module = info.factory(num_classes=num_classes, embedding_dim=embedding_dim, **base_params)
    for w in wrappers:
        _check_params(f"loss wrapper {w!r}", _WRAPPERS[w], wrapper_params[w], {"base"})
        module = _WRAPPERS[w](module, **wrapper_params[w])
    # Plain attribute (not a buffer): invisible to state_dict, survives pickling and deepcopy.
    module.registry_name = name
    return module


def registered_info(loss: torch.nn.Module) -> LossInfo | None:
    """The registry metadata of a module built by :func:`build_loss` (``None`` for any other module)."""
    name = getattr(loss, "registry_name", None)
    return loss_info(name) if isinstance(name, str) else None
