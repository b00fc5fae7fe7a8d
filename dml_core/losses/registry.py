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
import dataclasses
import importlib
import importlib.metadata
import inspect
import math
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# The protocol's shared recipe lives in dml_core.protocol (imported by dml_core.train too); re-exported here.
from dml_core.protocol import (
    MLRC_BATCH,
    MLRC_LOSS_WEIGHT_DECAY,
    MLRC_MODEL,
    MLRC_PAPER,
    BatchSpec,
    ModelRecipe,
)

__all__ = [
    "BatchSpec",
    "ModelRecipe",
    "LossInfo",
    "LossMetadata",
    "LossPluginError",
    "PluginDistribution",
    "ENTRY_POINT_GROUP",
    "MLRC_PAPER",
    "MLRC_BATCH",
    "MLRC_MODEL",
    "register",
    "register_wrapper",
    "loss_metadata",
    "build_loss",
    "list_losses",
    "list_wrappers",
    "list_plugin_losses",
    "check_plugin_losses",
    "loss_info",
    "resolve_loss",
    "plugin_space",
    "MLRC_LOSS_WEIGHT_DECAY",
    "registered_info",
]

#: Entry-point group through which an installed distribution offers losses (``docs/plugins.md``).
ENTRY_POINT_GROUP = "dml_reality_check.losses"
#: Where :func:`loss_metadata` stores its :class:`LossMetadata` (in the object's own ``__dict__``).
_METADATA_ATTR = "__dml_loss_metadata__"
#: Keys of a shipped search space, as in ``tune_spaces/*.yaml``.
_SPACE_KEYS = ("loss", "space", "fixed", "paper_defaults")


class LossPluginError(ValueError):
    """A loss from outside this package (import path or entry point) cannot be used; the message is one line
    that names the loss and what is wrong with it."""


@dataclass(frozen=True)
class PluginDistribution:
    """The installed distribution that provides a plugin loss (what a registered model must require)."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        """A pip requirement pinning this distribution: ``"name==version"``."""
        return f"{self.name}=={self.version}"

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


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


# --------------------------------------------------------------------------------------------------- plugin metadata
def _check_space_reference(space: Any) -> None:
    if space is None or isinstance(space, dict):
        return
    if not isinstance(space, str):
        raise TypeError(f"loss_metadata: space must be a mapping or 'package:relative/file.yaml', "
                        f"got {type(space).__name__}")
    package, sep, rel = space.partition(":")
    parts = rel.split("/")
    if (not sep or not package or not all(p.isidentifier() for p in package.split("."))
            or not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"loss_metadata: space {space!r} is not 'package:relative/file.yaml' (a file inside an "
                         "importable package, read with importlib.resources)")


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
    for key, value in (("learnable", learnable), ("own_optimizer", own_optimizer)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"loss_metadata: {key} must be true, false or None, got {value!r}")
    if batch is not None and not isinstance(batch, BatchSpec):
        raise TypeError(f"loss_metadata: batch must be a dml_core.losses.BatchSpec, got {type(batch).__name__}")
    if model is not None and not isinstance(model, ModelRecipe):
        raise TypeError(f"loss_metadata: model must be a dml_core.losses.ModelRecipe, got {type(model).__name__}")
    if (isinstance(loss_weight_decay, bool) or not isinstance(loss_weight_decay, (int, float))
            or not math.isfinite(loss_weight_decay) or loss_weight_decay < 0):
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


# --------------------------------------------------------------------------------------------------- name parsing
def _ensure_loaded() -> None:
    # Importing the package runs every module's @register decorators.
    import dml_core.losses  # noqa: F401


def _split_wrappers(name: str) -> tuple[list[str], str]:
    """``"sec:l2_reg:mylab.losses:Circle"`` -> (["sec", "l2_reg"], "mylab.losses:Circle"): wrappers outermost first."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a loss name must be a non-empty string, got {name!r}")
    wrappers: list[str] = []
    rest = name
    while ":" in rest:
        prefix, tail = rest.split(":", 1)
        if prefix not in _WRAPPERS:
            break
        if prefix in wrappers:
            raise ValueError(f"loss {name!r}: wrapper {prefix!r} is applied twice")
        wrappers.append(prefix)
        rest = tail
    if not rest:
        raise ValueError(f"loss {name!r}: no base loss after the wrapper(s)")
    return wrappers, rest


def list_losses() -> list[str]:
    """Every registered base-loss name, sorted.  Wrapped names (``sec:<base>``) are built on demand; plugin losses
    are listed by :func:`list_plugin_losses`."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def list_wrappers() -> list[str]:
    _ensure_loaded()
    return sorted(_WRAPPERS)


# --------------------------------------------------------------------------------------------------- plugins
def _dist_of_entry_point(ep: importlib.metadata.EntryPoint) -> PluginDistribution | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return PluginDistribution(dist.name, dist.version)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def list_plugin_losses() -> dict[str, tuple[PluginDistribution | None, ...]]:
    """Entry-point losses of the installed distributions: name -> the distribution(s) exporting it, sorted by name.

    Reads distribution metadata only; no plugin module is imported.  More than one distribution for a name is a
    clash that :func:`resolve_loss` refuses; a name that is also built in is shadowed by the built-in
    (:func:`check_plugin_losses` reports both).
    """
    found: dict[str, list[PluginDistribution | None]] = {}
    for ep in _entry_points():
        dists = found.setdefault(ep.name, [])
        dist = _dist_of_entry_point(ep)
        if dist not in dists:
            dists.append(dist)
    return {name: tuple(found[name]) for name in sorted(found)}


def _builtin_distribution() -> str:
    """This package's distribution name, for messages (``dml-reality-check`` when installed)."""
    names = _packages_distributions().get(__name__.split(".")[0]) or []
    return names[0] if names else "dml_core"


def _clash_message(name: str, eps: list[importlib.metadata.EntryPoint]) -> str:
    shown = " and ".join(f"{_dist_of_entry_point(ep) or '(unknown distribution)'} ({ep.value!r})" for ep in eps)
    return (f"loss {name!r}: entry point of group {ENTRY_POINT_GROUP!r} exported by more than one distribution: "
            f"{shown}; uninstall one, or name the loss by its import path")


def check_plugin_losses() -> None:
    """Raise :class:`LossPluginError` for the first entry-point loss that cannot be named unambiguously: one
    exported by two distributions, one named like a built-in loss (which always wins, so the plugin's would never
    be used) or one whose name contains ``:`` (parsed as a wrapper or an import path).  Imports no plugin module.
    A sweep's preflight calls it so that a shadowed or ambiguous plugin is an error before anything runs."""
    _ensure_loaded()
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in _entry_points():
        by_name.setdefault(ep.name, []).append(ep)
    for name in sorted(by_name):
        eps = by_name[name]
        dist = _dist_of_entry_point(eps[0]) or "(unknown distribution)"
        if name in _REGISTRY:
            raise LossPluginError(
                f"loss {name!r}: entry point of {dist} ({eps[0].value!r}, group {ENTRY_POINT_GROUP!r}) has the name "
                f"of a built-in loss of {_builtin_distribution()}, which always wins; rename the entry point or name "
                "the plugin's loss by its import path")
        if ":" in name:
            raise LossPluginError(f"loss {name!r}: entry point of {dist} (group {ENTRY_POINT_GROUP!r}) has a ':' in "
                                  "its name, which a loss name reads as a wrapper or an import path; rename it")
        if len({str(_dist_of_entry_point(ep)) for ep in eps}) > 1:
            raise LossPluginError(_clash_message(name, eps))


_PKG_DISTS: tuple[tuple[str, ...], dict[str, list[str]]] | None = None


def _packages_distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` (top-level module -> distributions), deduplicated and cached
    for the current ``sys.path`` (it reads every installed distribution's file list: slow)."""
    global _PKG_DISTS
    key = tuple(sys.path)
    if _PKG_DISTS is None or _PKG_DISTS[0] != key:
        mapping = {top: list(dict.fromkeys(names))
                   for top, names in importlib.metadata.packages_distributions().items()}
        _PKG_DISTS = (key, mapping)
    return _PKG_DISTS[1]


def _dist_of_module(module_name: str) -> PluginDistribution | None:
    """The installed distribution that provides ``module_name`` (``None`` for a module outside any)."""
    names = _packages_distributions().get(module_name.split(".")[0]) or []
    if len(names) > 1:  # a namespace package shared by several distributions: the one that ships the module
        rel = module_name.replace(".", "/")
        for candidate in names:
            try:
                files = importlib.metadata.distribution(candidate).files or []
            except importlib.metadata.PackageNotFoundError:
                continue
            if any(f.as_posix() in (rel + ".py", rel + "/__init__.py") for f in files):
                names = [candidate]
                break
    for candidate in names:
        try:
            dist = importlib.metadata.distribution(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
        return PluginDistribution(dist.name or candidate, dist.version)
    return None


def _raised_at(exc: BaseException) -> str:
    """``" (file:line)"`` of the frame that raised ``exc``, skipping the import machinery and this module."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" ({exc.filename}:{exc.lineno})"
    here = os.path.normcase(os.path.abspath(__file__))
    importlib_dir = os.path.normcase(os.path.dirname(os.path.abspath(importlib.__file__)))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.normcase(os.path.abspath(frame.filename)) if not frame.filename.startswith("<") else ""
        if not path or path == here or path.startswith(importlib_dir + os.sep):
            continue
        return f" ({frame.filename}:{frame.lineno})"
    return ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_object(module_name: str, attr: str, where: str) -> Any:
    """Import ``module_name`` and return ``attr`` (dotted) from it; failures are one-line :class:`LossPluginError`."""
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever the plugin raises, reported in one line
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and (
            module_name == e.name or module_name.startswith(e.name + "."))
        if missing:
            wrappers = ", ".join(sorted(_WRAPPERS))
            hint = "" if "." in module_name else f", and {module_name!r} is not a loss wrapper ({wrappers})"
            raise LossPluginError(f"{where}: cannot import module {module_name!r} ({_one_line(e)}): not installed or "
                                  f"not on sys.path{hint}") from None
        raise LossPluginError(f"{where}: cannot import module {module_name!r}: {_one_line(e)}{_raised_at(e)}") from None
    for i, part in enumerate(attr.split(".")):
        owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LossPluginError(f"{where}: {owner!r} has no attribute {part!r}") from None
        except Exception as e:  # noqa: BLE001 - a module __getattr__ or property of the plugin's
            raise LossPluginError(f"{where}: reading {part!r} of {owner!r} failed: {_one_line(e)}{_raised_at(e)}") \
                from None
    return obj


def _check_factory(obj: Any, target: str, where: str) -> None:
    """A loss factory is callable as ``obj(num_classes=..., embedding_dim=..., **hyperparameters)``."""
    if not callable(obj):
        raise LossPluginError(f"{where}: {target!r} is not callable ({type(obj).__name__}); a loss factory is a "
                              "function or nn.Module class called as factory(num_classes=..., embedding_dim=..., "
                              "**hyperparameters)")
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__init__ is torch.nn.Module.__init__:
        sig = inspect.Signature()  # nn.Module's own __init__(*args, **kwargs) only rejects what it is given
    else:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # no introspectable signature (some C callables): the call will tell
            return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [n for n in ("num_classes", "embedding_dim") if n not in params or params[n].kind not in keyword]
    if missing:
        raise LossPluginError(f"{where}: {target}{sig} does not take {' and '.join(missing)} as keyword argument"
                              f"{'s' if len(missing) > 1 else ''}; a loss factory is called as "
                              "factory(num_classes=..., embedding_dim=..., **hyperparameters)")


def _plugin_info(name: str, obj: Any, origin: str, distribution: PluginDistribution | None) -> LossInfo:
    meta = _own_metadata(obj) or LossMetadata()
    qualname = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"
    return LossInfo(
        name=name,
        factory=obj,
        paper=meta.paper or qualname,
        learnable=meta.learnable,
        own_optimizer=meta.learnable if meta.own_optimizer is None else meta.own_optimizer,
        batch=meta.batch,
        model=meta.model,
        description=meta.description,
        loss_weight_decay=meta.loss_weight_decay,
        origin=origin,
        distribution=distribution,
    )


def _resolve_import_path(base: str, name: str) -> LossInfo:
    module_name, _, attr = base.partition(":")
    where = f"loss {name!r}"
    if not (module_name and attr and all(p.isidentifier() for p in module_name.split(".") + attr.split("."))):
        first = name.split(":", 1)[0]
        raise LossPluginError(f"{where}: {base!r} is not an import path 'module:attribute' (e.g. "
                              f"'mylab.losses:CircleLoss'), and {first!r} is not a loss wrapper "
                              f"({', '.join(sorted(_WRAPPERS))})")
    obj = _load_object(module_name, attr, where)
    _check_factory(obj, base, where)
    return _plugin_info(base, obj, "import_path", _dist_of_module(module_name))


def _resolve_entry_point(base: str, name: str) -> LossInfo | None:
    eps = [ep for ep in _entry_points() if ep.name == base]
    if not eps:
        return None
    if len({str(_dist_of_entry_point(ep)) for ep in eps}) > 1:
        raise LossPluginError(_clash_message(base, eps))
    ep = eps[0]
    dist = _dist_of_entry_point(ep)
    where = f"loss {name!r} (entry point {ep.value!r} of {dist or '(unknown distribution)'})"
    if not ep.attr:
        raise LossPluginError(f"{where}: names a module, not a loss factory; the value must be 'module:attribute'")
    obj = _load_object(ep.module, ep.attr, where)
    _check_factory(obj, f"{ep.module}:{ep.attr}", where)
    return _plugin_info(base, obj, "entry_point", dist)


def _resolve_base(base: str, name: str) -> LossInfo:
    _ensure_loaded()
    if base in _REGISTRY:
        return _REGISTRY[base]
    if ":" in base:
        return _resolve_import_path(base, name)
    info = _resolve_entry_point(base, name)
    if info is not None:
        return info
    plugins = [n for n in list_plugin_losses() if n not in _REGISTRY]
    raise ValueError(
        f"unknown loss {base!r}; known: {', '.join(sorted(_REGISTRY))}"
        + (f"; plugins: {', '.join(plugins)}" if plugins else "")
        + "; or an import path 'module:attribute'")


def resolve_loss(name: str) -> LossInfo:
    """The :class:`LossInfo` of any loss name: built-in, import path or entry point, behind any wrappers
    (``"sec:<base>"`` gives the base loss's metadata).

    Built-in names are looked up first and never reach the plugin machinery.  Anything else imports the plugin's
    module (so a config that names a plugin fails here, before training, when the plugin is broken).  Raises
    ``ValueError`` for an unknown name and :class:`LossPluginError` (a ``ValueError``) for a plugin that cannot be
    used, each with a one-line message.
    """
    _ensure_loaded()
    _, base = _split_wrappers(name)
    return _resolve_base(base, name)


def loss_info(name: str) -> LossInfo:
    """Metadata for ``name``; for ``wrapper:base`` the base loss's metadata (:func:`resolve_loss`)."""
    return resolve_loss(name)


def plugin_space(name: str) -> dict[str, Any] | None:
    """The search space a plugin loss ships (``loss_metadata(space=...)``), as a raw mapping; ``None`` for built-in
    losses (their spaces are ``tune_spaces/*.yaml``) and plugins without one.

    For a wrapped name (``"sec:<plugin>"``) this is the base loss's space: the wrapper's own parameters
    (``sec_eta``, ...) are not in it.  A resource reference ``"package:relative/file.yaml"`` is read with
    :mod:`importlib.resources` and parsed as YAML.  Validation against the space format is the caller's.
    """
    info = resolve_loss(name)
    if info.origin == "builtin":
        return None
    meta = _own_metadata(info.factory)
    if meta is None or meta.space is None:
        return None
    if isinstance(meta.space, dict):
        return copy.deepcopy(meta.space)
    import importlib.resources

    import yaml

    package, _, rel = meta.space.partition(":")
    where = f"loss {name!r}: search space {meta.space!r}"
    try:
        resource = importlib.resources.files(package)
        for part in rel.split("/"):
            resource = resource / part
        text = resource.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LossPluginError(f"{where}: package {package!r} has no file {rel!r}") from None
    except Exception as e:  # noqa: BLE001 - the package does not import, or its loader cannot read the file
        raise LossPluginError(f"{where}: cannot read it: {_one_line(e)}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise LossPluginError(f"{where}: not valid YAML{at}: {problem}") from None
    if not isinstance(doc, dict):
        raise LossPluginError(f"{where}: expected a mapping with keys {', '.join(_SPACE_KEYS)}, "
                              f"got {type(doc).__name__}")
    return doc


# --------------------------------------------------------------------------------------------------- building
def _check_params(where: str, factory: Callable, params: dict[str, Any], reserved: set[str],
                  error: type[ValueError] = ValueError) -> None:
    """Reject parameters the factory does not take, naming them (before any training starts)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {n for n, p in sig.parameters.items()
                if n not in reserved and p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                        inspect.Parameter.POSITIONAL_ONLY)}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise error(
            f"{where}: unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(accepted)) or '(none)'}"
        )


def _check_call(where: str, factory: Callable, kwargs: dict[str, Any]) -> None:
    """A plugin factory's required arguments are all given (``missing a required argument: 'margin'``)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise LossPluginError(f"{where}: {e}") from None


def build_loss(name: str, *, num_classes: int, embedding_dim: int, **params: Any) -> torch.nn.Module:
    """Build a loss by name: built-in, import path ``"module:attribute"`` or entry point (:func:`resolve_loss`).
    ``loss(embeddings, labels)`` returns a scalar.

    Wrappers: ``"sec:<base>"`` / ``"l2_reg:<base>"`` (also around a plugin loss, and nested:
    ``"sec:l2_reg:<base>"``); equivalently, passing a wrapper's parameter (``sec_eta=...``, ``l2_reg_eta=...``)
    to any base loss applies that wrapper.  Wrapper parameters always carry the wrapper's prefix, so they never
    collide with a base loss's own symbols.
    """
    _ensure_loaded()
    named, base = _split_wrappers(name)
    info = _resolve_base(base, name)
    plugin = info.origin != "builtin"
    wrappers: list[str] = list(reversed(named))  # applied innermost first
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
    where = f"loss {info.name!r}"
    _check_params(where, info.factory, base_params, {"num_classes", "embedding_dim"},
                  LossPluginError if plugin else ValueError)
    kwargs = dict(num_classes=num_classes, embedding_dim=embedding_dim, **base_params)
    if plugin:
        _check_call(where, info.factory, kwargs)
    module = info.factory(**kwargs)
    if plugin and not isinstance(module, torch.nn.Module):
        raise LossPluginError(f"{where}: the factory returned a {type(module).__name__}, not a torch.nn.Module")
    for w in wrappers:
        _check_params(f"loss wrapper {w!r}", _WRAPPERS[w], wrapper_params[w], {"base"})
        module = _WRAPPERS[w](module, **wrapper_params[w])
    # Plain attribute (not a buffer): invisible to state_dict, survives pickling and deepcopy.  The name as given,
    # so that whoever rebuilds the loss from it (a worker, a re-evaluation) resolves it the same way.
    module.registry_name = name
    return module


def registered_info(loss: torch.nn.Module) -> LossInfo | None:
    """The registry metadata of a module built by :func:`build_loss` (``None`` for any other module).

    A plugin loss that did not declare ``learnable`` gets it from this module: learnable when it has a parameter
    with ``requires_grad`` (``own_optimizer`` follows unless declared).
    """
    name = getattr(loss, "registry_name", None)
    if not isinstance(name, str):
        return None
    info = loss_info(name)
    if info.learnable is None:
        learnable = any(p.requires_grad for p in loss.parameters())
        own = learnable if info.own_optimizer is None else info.own_optimizer
        info = dataclasses.replace(info, learnable=learnable, own_optimizer=own)
    return info
