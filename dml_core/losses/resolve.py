"""Names → losses: :func:`resolve_loss` turns a built-in name, an import path ``"module:attribute"`` or an entry
point of the group ``dml_reality_check.losses`` (wrappers ``sec:``/``l2_reg:`` around any of them) into a
:class:`~dml_core.losses.registry.LossInfo`; :func:`loss_info`, :func:`build_loss` and :func:`registered_info` go
through it.  Importing this module loads the built-in zoo (each module registers its losses in
:data:`dml_core.losses.registry.LOSS_REGISTRY`, whose entry-point lookup this module words)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import importlib.resources
import inspect
from typing import Any, Callable

import torch
import yaml

# The built-in zoo: importing each module registers its losses.  Keep this list in sync with docs/losses.md.
import dml_core.losses.baselines  # noqa: F401 - registers the reality-check baselines (pytorch-metric-learning)
import dml_core.losses.group_loss  # noqa: F401 - registers its losses
import dml_core.losses.multi_proxy_anchor  # noqa: F401 - registers its losses
import dml_core.losses.proxynca  # noqa: F401 - registers its losses
import dml_core.losses.rsw  # noqa: F401 - registers its losses
import dml_core.losses.sec  # noqa: F401 - registers its losses
from dml_core import plugins
from dml_core.losses.registry import (
    _SPACE_KEYS,
    _WRAPPERS,
    ENTRY_POINT_GROUP,
    LOSS_REGISTRY,
    LossInfo,
    LossMetadata,
    LossPluginError,
    _own_metadata,
)
from dml_core.plugins import (
    IMPORT_PATH,
    LossFactory,
    PluginDistribution,
    distribution_of_entry_point,
    keyword_parameters,
)
from dml_core.registry import UnknownNameError

__all__ = [
    "LOSS_REGISTRY",  # re-exported: importing this module has registered the zoo in it
    "resolve_loss",
    "loss_info",
    "build_loss",
    "registered_info",
    "list_losses",
    "list_wrappers",
    "list_plugin_losses",
    "check_plugin_losses",
    "plugin_space",
    "UnknownLossError",
]

#: What the loss contract passes every factory by keyword: ("num_classes", "embedding_dim").
_FACTORY_KEYWORDS = keyword_parameters(LossFactory)


# --------------------------------------------------------------------------------------------------- name parsing
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
    return sorted(LOSS_REGISTRY.names())


def list_wrappers() -> list[str]:
    return sorted(_WRAPPERS)


class UnknownLossError(UnknownNameError):
    """A name that is no built-in loss, no installed entry point and no import path.  ``str(e)`` is the one wording
    of it (a config error prints :meth:`message` with its own way of showing the name); ``known`` lists the names
    that would have worked, for a did-you-mean."""

    def __init__(self, name: str):
        self.wrappers = list_wrappers()
        super().__init__("loss", name, list_losses(), LOSS_REGISTRY.plugin_names())

    def message(self, shown: Callable[[Any], str] = repr) -> str:
        """``unknown loss 'x' (known: ..., sec:<base>; plugins: ...; or an import path 'package.module:attribute')``."""
        known = self.known + [f"{w}:<base>" for w in self.wrappers]
        installed = f"; plugins: {', '.join(self.plugins)}" if self.plugins else ""
        return (
            f"unknown loss {shown(self.name)} (known: {', '.join(known)}{installed}; or an import path "
            "'package.module:attribute')"
        )


# --------------------------------------------------------------------------------------------------- plugins
def list_plugin_losses() -> dict[str, tuple[PluginDistribution | None, ...]]:
    """Entry-point losses of the installed distributions: name -> the distribution(s) exporting it, sorted by name.

    Reads distribution metadata only; no plugin module is imported.  More than one distribution for a name is a
    clash that :func:`resolve_loss` refuses; a name that is also built in is shadowed by the built-in
    (:func:`check_plugin_losses` reports both).
    """
    return LOSS_REGISTRY.plugins()


def _builtin_distribution() -> str:
    """This package's distribution name, for messages (``dml-reality-check`` when installed)."""
    dist = plugins.distribution_of_module(__name__.split(".")[0])
    return dist.name if dist is not None else "dml_core"


def _clash_message(name: str, eps: list[importlib.metadata.EntryPoint]) -> str:
    shown = " and ".join(f"{distribution_of_entry_point(ep) or '(unknown distribution)'} ({ep.value!r})" for ep in eps)
    return (
        f"loss {name!r}: entry point of group {ENTRY_POINT_GROUP!r} exported by more than one distribution: "
        f"{shown}; uninstall one, or name the loss by its import path"
    )


def _shadow_message(name: str, eps: list[importlib.metadata.EntryPoint]) -> str:
    dist = distribution_of_entry_point(eps[0]) or "(unknown distribution)"
    return (
        f"loss {name!r}: entry point of {dist} ({eps[0].value!r}, group {ENTRY_POINT_GROUP!r}) has the name "
        f"of a built-in loss of {_builtin_distribution()}, which always wins; rename the entry point or name "
        "the plugin's loss by its import path"
    )


def _lookup(name: str) -> importlib.metadata.EntryPoint | None:
    """The entry point of a loss name (:meth:`dml_core.registry.Registry.lookup`, the trunks' and dataset kinds'
    lookup too), in the losses' words; one named like a built-in loss is refused."""
    return LOSS_REGISTRY.lookup(name, clash=_clash_message, shadowed=_shadow_message)


def check_plugin_losses() -> None:
    """Raise :class:`LossPluginError` for the first entry-point loss that cannot be named unambiguously: one
    exported by two distributions, one named like a built-in loss (which always wins, so the plugin's would never
    be used) or one whose name contains ``:`` (parsed as a wrapper or an import path).  Imports no plugin module.
    A sweep's preflight calls it so that a shadowed or ambiguous plugin is an error before anything runs."""
    by_name: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in LOSS_REGISTRY.entry_points():
        by_name.setdefault(ep.name, ep)
    for name in sorted(by_name):
        if ":" in name:  # no built-in name has one
            dist = distribution_of_entry_point(by_name[name]) or "(unknown distribution)"
            raise LossPluginError(
                f"loss {name!r}: entry point of {dist} (group {ENTRY_POINT_GROUP!r}) has a ':' in "
                "its name, which a loss name reads as a wrapper or an import path; rename it"
            )
        _lookup(name)


def _load_object(module_name: str, attr: str, where: str) -> Any:
    """Import ``module_name`` and return ``attr`` (dotted) from it; failures are one-line :class:`LossPluginError`."""
    try:
        return plugins.load_object(module_name, attr, what=where)
    except plugins.PluginError as e:
        hint = ""
        if isinstance(e, plugins.PluginImportError) and e.missing and "." not in module_name:
            hint = f", and {module_name!r} is not a loss wrapper ({', '.join(sorted(_WRAPPERS))})"
        raise LossPluginError(f"{e}{hint}") from None


def _check_factory(obj: Any, target: str, where: str) -> None:
    """``obj`` fits :class:`~dml_core.plugins.LossFactory`: callable, taking its keywords (``num_classes``,
    ``embedding_dim``) by name."""
    if not isinstance(obj, LossFactory):
        raise LossPluginError(
            f"{where}: {target!r} is not callable ({type(obj).__name__}); a loss factory is a "
            "function or nn.Module class called as factory(num_classes=..., embedding_dim=..., "
            "**hyperparameters)"
        )
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
    missing = [n for n in _FACTORY_KEYWORDS if n not in params or params[n].kind not in keyword]
    if missing:
        raise LossPluginError(
            f"{where}: {target}{sig} does not take {' and '.join(missing)} as keyword argument"
            f"{'s' if len(missing) > 1 else ''}; a loss factory is called as "
            "factory(num_classes=..., embedding_dim=..., **hyperparameters)"
        )


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
    if not IMPORT_PATH.fullmatch(base):
        first = name.split(":", 1)[0]
        raise LossPluginError(
            f"{where}: {base!r} is not an import path 'module:attribute' (e.g. "
            f"'mylab.losses:CircleLoss'), and {first!r} is not a loss wrapper "
            f"({', '.join(sorted(_WRAPPERS))})"
        )
    obj = _load_object(module_name, attr, where)
    _check_factory(obj, base, where)
    return _plugin_info(base, obj, "import_path", plugins.distribution_of_module(module_name))


def _resolve_entry_point(base: str, name: str) -> LossInfo | None:
    ep = _lookup(base)
    if ep is None:
        return None
    dist = distribution_of_entry_point(ep)
    where = f"loss {name!r} (entry point {ep.value!r} of {dist or '(unknown distribution)'})"
    if not ep.attr:
        raise LossPluginError(f"{where}: names a module, not a loss factory; the value must be 'module:attribute'")
    obj = _load_object(ep.module, ep.attr, where)
    _check_factory(obj, f"{ep.module}:{ep.attr}", where)
    return _plugin_info(base, obj, "entry_point", dist)


def _resolve_base(base: str, name: str) -> LossInfo:
    builtin = LOSS_REGISTRY.get(base)
    if builtin is not None:
        return builtin
    if ":" in base:
        return _resolve_import_path(base, name)
    info = _resolve_entry_point(base, name)
    if info is not None:
        return info
    raise UnknownLossError(base)


def resolve_loss(name: str) -> LossInfo:
    """The :class:`LossInfo` of any loss name: built-in, import path or entry point, behind any wrappers
    (``"sec:<base>"`` gives the base loss's metadata).

    Built-in names are looked up first and never reach the plugin machinery. Anything else imports the plugin's module
    (so a config that names a plugin fails here, before training, when the plugin is broken). Raises
    :class:`UnknownLossError` (a ``ValueError``) for an unknown name and :class:`LossPluginError` (a
    ``ValueError``) for a plugin that cannot be used, each with a one-line message.
    """
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

    package, _, rel = meta.space.partition(":")
    where = f"loss {name!r}: search space {meta.space!r}"
    try:
        resource = importlib.resources.files(package)
        for part in rel.split("/"):
            resource = resource / part
        text = resource.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LossPluginError(f"{where}: package {package!r} has no file {rel!r}") from None
    except Exception as e:  # the package does not import, or its loader cannot read the file
        raise LossPluginError(f"{where}: cannot read it: {plugins.one_line(e)}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise LossPluginError(f"{where}: not valid YAML{at}: {problem}") from None
    if not isinstance(doc, dict):
        raise LossPluginError(
            f"{where}: expected a mapping with keys {', '.join(_SPACE_KEYS)}, got {type(doc).__name__}"
        )
    return doc


# --------------------------------------------------------------------------------------------------- building
def _check_params(
    where: str, factory: Callable, params: dict[str, Any], reserved: set[str], error: type[ValueError] = ValueError
) -> None:
    """Reject parameters the factory does not take, naming them (before any training starts)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {
        n
        for n, p in sig.parameters.items()
        if n not in reserved and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    }
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise error(
            f"{where}: unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(sorted(accepted)) or '(none)'}"
        )


def _check_call(where: str, factory: Callable, kwargs: dict[str, Any]) -> None:
    """A plugin factory's required arguments are all given by the contract's keywords and the hyperparameters
    (``missing a required argument: 'margin'``)."""
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
    _check_params(where, info.factory, base_params, set(_FACTORY_KEYWORDS), LossPluginError if plugin else ValueError)
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
    setattr(module, "registry_name", name)  # nn.Module's __setattr__ is typed for tensors and modules only
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
