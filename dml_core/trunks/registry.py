"""One resolver for every kind of trunk name (``docs/trunks.md``):

==============================  =============================================================================
``tiny``, ``resnet18``, …       built-in (:data:`BUILTIN_TRUNKS`)
``timm:<model>``                a model of the timm registry (:mod:`dml_core.trunks.timm_trunk`)
``package.module:attr``         a callable from user code, by import path (:mod:`dml_core.trunks.plugins`)
``<name>``                      an installed entry point of the group ``dml_reality_check.trunks``
==============================  =============================================================================

:data:`TRUNK_REGISTRY` (a :class:`dml_core.registry.Registry`, the shape the losses' and dataset kinds' share)
holds the built-ins' specs, registered from :data:`BUILTIN_TRUNKS`, and finds the entry points.
:func:`resolve_trunk` validates a name and returns a :class:`TrunkSpec` without building anything;
``spec.build(pretrained)`` builds the trunk (and loads weights from a local file or an ``s3://`` object).
Entry points are only looked at for names that are not built in, except to refuse an installed entry point that
takes a built-in name.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from torch import nn

from dml_core.plugins import (
    PluginDistribution,
    TrunkPluginError,
    distribution_of_entry_point,
    distribution_of_module,
    installed_distribution,
)
from dml_core.registry import Registry, UnknownNameError
from dml_core.trunks import plugins
from dml_core.trunks.builtin import BUILTIN_TRUNKS, FEATURE_DIMS, build_builtin, builtin_preprocessing, head_prefixes
from dml_core.trunks.preprocessing import IMAGENET_PREPROCESSING, Preprocessing
from dml_core.trunks.timm_trunk import (
    TIMM_PREFIX,
    _timm,
    build_timm_trunk,
    check_timm_name,
    timm_head_prefixes,
    timm_preprocessing,
)
from dml_core.trunks.weights import load_trunk_weights, local_weights

__all__ = [
    "TRUNK_REGISTRY",
    "TrunkSpec",
    "UnknownTrunkError",
    "resolve_trunk",
    "check_trunk",
    "trunk_preprocessing",
    "list_trunks",
    "TRUNK_KINDS",
]

TRUNK_KINDS = ("builtin", "timm", "import", "entry_point")

# (local weights file or None, how errors name it) -> (trunk module, feature_dim)
_Factory = Callable[..., tuple]


@dataclass(frozen=True, eq=False)
class TrunkSpec:
    """A resolved trunk name.

    ``name``: the name as given; ``kind``: one of :data:`TRUNK_KINDS`; ``source``: where it comes from, for humans
    (``built-in``, ``timm 1.0.x``, ``import path``, ``entry point of <distribution> <version>``).
    ``build(pretrained=None) -> (module, feature_dim)``: a fresh trunk mapping (B, 3, H, W) to (B, feature_dim, H',
    W'), with the weights of ``pretrained`` (a local path or ``s3://`` URI) loaded.  ``preprocessing``: the input
    convention of its pretrained weights (:class:`Preprocessing`).  ``distribution``: the installed distribution
    providing the trunk's code, for a registered model to require — the plugin's for an import path or entry point
    (``None`` for an import path outside any installed distribution), timm's for ``timm:`` trunks, ``None`` for
    built-ins (part of this package).
    """

    name: str
    kind: str
    source: str
    _factory: _Factory = field(repr=False)
    _declared: Preprocessing | None = field(default=None, repr=False)
    distribution: PluginDistribution | None = None

    def build(self, pretrained: str | os.PathLike | None = None) -> tuple[nn.Module, int]:
        """The trunk module and its feature dimension; ``pretrained`` is read (downloaded from S3 if needed) here."""
        with local_weights(pretrained, self.name) as path:
            return self._factory(path, pretrained)

    def preprocessing_for(self, module: nn.Module | None) -> Preprocessing:
        """The preprocessing, given the module built from this spec (plugins may declare it on the module only)."""
        if self._declared is not None:
            return self._declared
        if self.kind in ("import", "entry_point"):
            if module is None:
                module, _ = self.build(None)
            declared = plugins.declared_preprocessing(module, f"{self.name}()", self.name)
            return declared if declared is not None else IMAGENET_PREPROCESSING
        return IMAGENET_PREPROCESSING

    @cached_property
    def preprocessing(self) -> Preprocessing:
        """Declared without building for built-in and timm trunks and plugins that declare it on the callable; a
        plugin declaring it on its module only is built once (without weights) to read it."""
        return self.preprocessing_for(None)


def _builtin_spec(name: str) -> TrunkSpec:
    def factory(path, shown):
        module = build_builtin(name, pretrained=path is not None)
        if path is not None:
            load_trunk_weights(module, path, name, ignore_prefixes=head_prefixes(name), shown=shown)
        return module, FEATURE_DIMS[name]

    return TrunkSpec(name, "builtin", "built-in", factory, builtin_preprocessing(name))


def _timm_spec(name: str) -> TrunkSpec:
    model = name[len(TIMM_PREFIX) :]
    check_timm_name(model, name)

    def factory(path, shown):
        trunk = build_timm_trunk(model, name)
        if path is not None:
            load_trunk_weights(trunk.model, path, name, ignore_prefixes=timm_head_prefixes(model), shown=shown)
        return trunk, trunk.feature_dim

    return TrunkSpec(
        name, "timm", f"timm {_timm().__version__}", factory, timm_preprocessing(model), installed_distribution("timm")
    )


def _plugin_spec(
    name: str, kind: str, source: str, module: str, attr: str, what: str, distribution: PluginDistribution | None
) -> TrunkSpec:
    obj = plugins.load_object(module, attr, name, what)
    ref = f"{module}:{attr}"
    plugins.check_signature(obj, ref, name)
    declared = plugins.declared_preprocessing(obj, ref, name)

    def factory(path, shown):
        trunk, took_weights = plugins.call_factory(obj, ref, name, path)
        dim = plugins.feature_dim_of(trunk, ref, name)
        if path is not None and not took_weights:
            load_trunk_weights(trunk, path, name, shown=shown)
        return trunk, dim

    return TrunkSpec(name, kind, source, factory, declared, distribution)


#: The built-in trunks (name -> :class:`TrunkSpec`, from :data:`BUILTIN_TRUNKS`) and the entry points of
#: ``dml_reality_check.trunks``.
TRUNK_REGISTRY: Registry[TrunkSpec] = Registry("trunk", plugins.ENTRY_POINT_GROUP, TrunkPluginError)
for _name in BUILTIN_TRUNKS:
    TRUNK_REGISTRY.register(_name, _builtin_spec(_name))


class UnknownTrunkError(UnknownNameError):
    """A trunk name that is no built-in, no ``timm:`` name, no import path and no installed entry point; the
    message says what a trunk name can be, with a did-you-mean."""

    def __init__(self, name: str):
        installed = list(TRUNK_REGISTRY.plugins())  # every installed name, a built-in's too: it is listed as installed
        super().__init__("trunk", name, list(TRUNK_REGISTRY.names()), installed)

    def message(self, shown: Callable[[Any], str] = repr) -> str:
        """``unknown trunk 'x': a trunk is a built-in name (...), 'timm:<model name>', ...; did you mean 'y'?``."""
        close = difflib.get_close_matches(self.name, self.known + self.plugins, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return (
            f"unknown trunk {shown(self.name)}: a trunk is a built-in name ({', '.join(self.known)}), "
            "'timm:<model name>', an import path 'package.module:callable' or an installed entry point of group "
            f"{plugins.ENTRY_POINT_GROUP} ({', '.join(self.plugins) if self.plugins else 'none installed'}){hint}"
        )


def _entry_point(name: str) -> importlib.metadata.EntryPoint | None:
    """The installed entry point called ``name`` (``None`` when there is none), in the trunks' words: two
    distributions exporting it, or one exporting a built-in trunk's name, is a :class:`TrunkPluginError`."""
    return TRUNK_REGISTRY.lookup(name, clash=plugins.clash_message, shadowed=plugins.shadowed_message)


def resolve_trunk(name: str) -> TrunkSpec:
    """The :class:`TrunkSpec` of ``name``, validated without building a model: a built-in name, ``timm:<model>``
    (a registry name of the installed timm), ``package.module:attr`` (imported, looked up, checked callable) or an
    entry point (loaded the same way).  Anything wrong is a ``ValueError`` with one message."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"trunk must be a non-empty name without surrounding spaces, got {name!r}")
    builtin = TRUNK_REGISTRY.get(name)
    if builtin is not None:
        _entry_point(name)  # an installed plugin must not shadow a built-in
        return builtin
    if name.startswith(TIMM_PREFIX):
        return _timm_spec(name)
    if ":" in name:
        if not plugins.IMPORT_PATH.fullmatch(name):
            raise ValueError(
                f"trunk {name!r} is neither 'timm:<model name>' nor an import path 'package.module:callable'"
            )
        module, attr = name.split(":", 1)
        return _plugin_spec(
            name, "import", "import path", module, attr, f"import path {name!r}", distribution_of_module(module)
        )
    ep = _entry_point(name)
    if ep is None:
        raise UnknownTrunkError(name)
    dist = plugins.distribution_of(ep)
    what = f"entry point {name!r} = {ep.value!r} of {dist!r}"
    if not ep.attr or not plugins.IMPORT_PATH.fullmatch(f"{ep.module}:{ep.attr}"):
        raise plugins.TrunkPluginError(f"trunk {name!r}: {what} must name 'package.module:callable'")
    return _plugin_spec(
        name, "entry_point", f"entry point of {dist}", ep.module, ep.attr, what, distribution_of_entry_point(ep)
    )


def check_trunk(name: str) -> TrunkSpec:
    """Validate a trunk name for a config, as :func:`resolve_trunk` (nothing is built: built-ins by name, ``timm:``
    names against timm's registry, import paths imported, entry points installed and loadable); returns the spec."""
    return resolve_trunk(name)


def trunk_preprocessing(name: str) -> Preprocessing:
    """The input convention of trunk ``name``'s pretrained weights (see :class:`TrunkSpec.preprocessing`)."""
    return resolve_trunk(name).preprocessing


def list_trunks() -> dict[str, str]:
    """Trunk names usable without a prefix — the built-ins and the installed entry points — and where each comes
    from (metadata only: no plugin is imported).  ``timm:<model>`` and import paths are open-ended and not listed."""
    out = {name: "built-in" for name in TRUNK_REGISTRY.names()}
    for ep in TRUNK_REGISTRY.entry_points():
        out.setdefault(ep.name, f"entry point of {plugins.distribution_of(ep)}")
    return out
