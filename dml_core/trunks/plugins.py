"""Trunks from user code: an import path ``"package.module:attr"`` or an installed entry point of the group
``dml_reality_check.trunks`` (``docs/trunks.md`` has the contract and examples).

The object named is a callable taking no required argument (it may take ``pretrained=``) that returns an
``nn.Module`` mapping (B, 3, H, W) images to a (B, C, H, W) feature map and having an int ``feature_dim`` (or
``num_features``, timm's name) — C.  An optional ``preprocessing`` (a :class:`Preprocessing` or a dict of its
fields) on the callable, else on the module, declares its input convention; the ImageNet one otherwise.

The contract is in code: :class:`~dml_core.plugins.TrunkFactory` (the callable) and
:class:`~dml_core.plugins.TrunkModule` (what it returns); the probes here read their names from them.

Every way this can go wrong is a :class:`~dml_core.plugins.TrunkPluginError` (a ``PluginError``, so a
``ValueError``) with one message naming the trunk, never a traceback through this module: the module does not import
(the plugin's exception type, message and the file:line it came from), no such attribute, not callable, required
arguments, the call raises, a result that is not an ``nn.Module``, no usable feature dimension, a bad
``preprocessing``, an entry-point name exported by two distributions or clashing with a built-in trunk. Importing
and distributions go through :mod:`dml_core.plugins` (shared with the plugin losses and dataset kinds), entry points
through :data:`dml_core.trunks.registry.TRUNK_REGISTRY`; the wording of the messages is this module's.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from torch import nn

from dml_core.plugins import (
    IMPORT_PATH,
    PluginAttributeError,
    PluginImportError,
    TrunkFactory,
    TrunkModule,
    TrunkPluginError,
    distribution_of_entry_point,
    keyword_parameters,
    one_line,
    raised_at,
)
from dml_core.plugins import load_object as _load
from dml_core.trunks.preprocessing import Preprocessing

__all__ = [
    "ENTRY_POINT_GROUP",
    "IMPORT_PATH",
    "TrunkPluginError",
    "load_object",
    "clash_message",
    "shadowed_message",
    "call_factory",
    "feature_dim_of",
    "declared_preprocessing",
]

ENTRY_POINT_GROUP = "dml_reality_check.trunks"
#: The one argument the trunk contract may pass a factory: ("pretrained",).
_FACTORY_KEYWORDS = keyword_parameters(TrunkFactory)
#: Where a trunk module tells its channel count: the contract's attribute, then timm's name for it.
_FEATURE_DIM_ATTRS = (*TrunkModule.__annotations__, "num_features")


def load_object(module: str, attr: str, trunk: str, what: str):
    """``module`` imported and ``attr`` (dotted) looked up in it; ``what`` says where the reference came from in
    error messages (``'pkg.mod:build'`` or ``entry point 'x' of distribution 'd 1.0'``)."""
    try:
        obj = _load(module, attr, what=f"trunk {trunk!r}")
    except PluginImportError as e:
        raise TrunkPluginError(
            f"trunk {trunk!r}: cannot import module {module!r} ({what}): {one_line(e.cause)}"
            f"{raised_at(e.cause, labelled=True)}"
        ) from None
    except PluginAttributeError as e:
        if e.cause is None:
            raise TrunkPluginError(f"trunk {trunk!r}: {e.owner!r} has no attribute {e.part!r} ({what})") from None
        raise TrunkPluginError(
            f"trunk {trunk!r}: looking up {e.part!r} in {e.owner!r} raised {one_line(e.cause)}"
            f"{raised_at(e.cause, labelled=True)}"
        ) from None
    if not isinstance(obj, TrunkFactory):
        raise TrunkPluginError(
            f"trunk {trunk!r}: {module}:{attr} is a {type(obj).__name__}, not a callable returning the "
            f"trunk module ({what})"
        )
    return obj


def distribution_of(ep) -> str:
    """The distribution declaring ``ep`` as ``"name version"``, for messages."""
    dist = distribution_of_entry_point(ep)
    return "an unknown distribution" if dist is None else str(dist)


def _sides(eps: list) -> str:
    return " and ".join(f"{distribution_of(ep)!r} ({ep.value})" for ep in eps)


def shadowed_message(name: str, eps: list) -> str:
    """An entry point exporting the name of a built-in trunk, both sides named (for
    :meth:`~dml_core.registry.Registry.lookup`)."""
    return (
        f"trunk {name!r}: the entry point {name!r} of {_sides(eps)} (group {ENTRY_POINT_GROUP}) "
        f"clashes with the built-in trunk {name!r} of 'dml-reality-check'; rename the entry point or "
        "uninstall that distribution"
    )


def clash_message(name: str, eps: list) -> str:
    """A trunk name exported by two distributions, both named (for :meth:`~dml_core.registry.Registry.lookup`)."""
    return (
        f"trunk {name!r} is exported by two distributions: {_sides(eps)} (entry point group "
        f"{ENTRY_POINT_GROUP}); uninstall one, or name the trunk by its import path"
    )


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins and C extensions have none
        return None


def check_signature(obj, ref: str, trunk: str) -> bool:
    """Whether ``obj`` takes ``pretrained=`` (the :class:`~dml_core.plugins.TrunkFactory` keyword); a
    :class:`TrunkPluginError` when it has required arguments besides it."""
    sig = _signature(obj)
    if sig is None:
        return False
    params = sig.parameters.values()
    required = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.name not in _FACTORY_KEYWORDS
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise TrunkPluginError(
            f"trunk {trunk!r}: {ref} must be callable without arguments (pretrained= aside), but it requires {required}"
        )
    return any(p.name in _FACTORY_KEYWORDS or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call_factory(obj, ref: str, trunk: str, pretrained: Path | None) -> tuple[nn.Module, bool]:
    """Call the plugin: ``obj(pretrained=<local path or None>)`` if it takes ``pretrained``, else ``obj()``.
    Returns the module and whether the plugin took the weights file itself."""
    takes_pretrained = check_signature(obj, ref, trunk)
    try:
        module = obj(pretrained=None if pretrained is None else str(pretrained)) if takes_pretrained else obj()
    except Exception as e:
        raise TrunkPluginError(f"trunk {trunk!r}: {ref}() raised {one_line(e)}{raised_at(e, labelled=True)}") from None
    if not isinstance(module, nn.Module):
        raise TrunkPluginError(f"trunk {trunk!r}: {ref}() returned a {type(module).__name__}, not a torch.nn.Module")
    return module, takes_pretrained


def feature_dim_of(module: nn.Module, ref: str, trunk: str) -> int:
    """The module's ``feature_dim`` (:class:`~dml_core.plugins.TrunkModule`; else timm's ``num_features``): a
    positive int, or a :class:`TrunkPluginError`."""
    for attr in _FEATURE_DIM_ATTRS:
        value = getattr(module, attr, None)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrunkPluginError(
                    f"trunk {trunk!r}: {ref}() returned a module whose {attr} is {value!r}, not a "
                    "positive int (the channel count of its feature map)"
                )
            return value
    raise TrunkPluginError(
        f"trunk {trunk!r}: {ref}() returned a {type(module).__name__} without an int feature_dim (or "
        "num_features) attribute: the channel count C of its (B, C, H, W) feature map"
    )


def declared_preprocessing(obj, ref: str, trunk: str) -> Preprocessing | None:
    """``obj.preprocessing`` as a :class:`Preprocessing` (``None`` when absent); a bad value is a ``ValueError``
    (:meth:`Preprocessing.coerce`'s)."""
    value = getattr(obj, "preprocessing", None)
    if value is None or isinstance(value, property) or callable(value) and not isinstance(value, (Preprocessing, dict)):
        return None  # absent, or an instance property / method: read from the built module instead
    return Preprocessing.coerce(value, where=f"trunk {trunk!r}: {ref}.preprocessing")
