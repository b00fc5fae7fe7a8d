"""One registry per kind of named component — losses, trunks, dataset kinds — all of one shape, :class:`Registry`
(timm's model registry is the model: one table, a decorator or call that fills it, one lookup).

A registry holds the built-ins its package registers, in registration order: the one table of their names, which
the kind's resolver, the sweep config's validator and ``dmlrc list`` all read.  Beside them it finds the plug-ins
that installed distributions export as entry points of the kind's group — from installed metadata only: a plug-in's
code is imported by the kind's resolver, and only when a user names that plug-in.  An entry point can never stand
for a built-in's name (:meth:`Registry.lookup` refuses it when asked for that name), nor can two distributions
export one name.

The three registries: :data:`dml_core.losses.registry.LOSS_REGISTRY`, :data:`dml_core.trunks.registry.TRUNK_REGISTRY`
and :data:`dml_core.datasets.registry.DATASET_KIND_REGISTRY`.  What a plug-in object must be (its contract, in
:mod:`dml_core.plugins`) and how a kind words its own messages stay with that kind; the defaults here are the
dataset kinds'.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from dml_core import plugins
from dml_core.plugins import PluginDistribution, PluginError, distribution_of_entry_point

__all__ = ["Registry", "UnknownNameError", "EntryPointMessage"]

T = TypeVar("T")
#: The wording of a refused entry point: ``message(name, entry_points)`` (see :meth:`Registry.lookup`).
EntryPointMessage = Callable[[str, list[importlib.metadata.EntryPoint]], str]


class UnknownNameError(ValueError):
    """A name that is neither built in nor exported by an installed entry point.  ``known``: the built-in names,
    ``plugins``: the installed plug-ins' other names (what would have worked, for a did-you-mean); ``str(e)`` is
    :meth:`message`, which a config error prints with its own way of showing the name."""

    def __init__(self, kind: str, name: str, known: list[str], plugins: list[str]):
        self.kind = kind
        self.name = name
        self.known = known
        self.plugins = plugins
        super().__init__(self.message())

    def message(self, shown: Callable[[Any], str] = repr) -> str:
        """``unknown <kind> 'x' (known: a, b; plugins: c)``."""
        installed = f"; plugins: {', '.join(self.plugins)}" if self.plugins else ""
        return f"unknown {self.kind} {shown(self.name)} (known: {', '.join(self.known)}{installed})"


def _dist(ep: importlib.metadata.EntryPoint) -> str:
    return str(distribution_of_entry_point(ep) or "(unknown distribution)")


class Registry(Generic[T]):
    """The names of one kind of component: the built-ins (name → the kind's object ``T``) and the entry points of
    ``group``.  ``kind`` names the kind in messages (``"loss"``, ``"trunk"``, ``"dataset kind"``); ``error`` is the
    kind's :class:`~dml_core.plugins.PluginError`, raised for an entry point that cannot be used."""

    def __init__(self, kind: str, group: str, error: type[PluginError]):
        self.kind = kind
        self.group = group
        self.error = error
        self._builtins: dict[str, T] = {}
        #: The built-ins, name → object, in registration order (read-only: :meth:`register` fills it).
        self.builtins: Mapping[str, T] = MappingProxyType(self._builtins)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r}, builtins={list(self._builtins)})"

    # ------------------------------------------------------------------------------------------------ built-ins
    def register(self, name: str, obj: T) -> T:
        """Add the built-in ``obj`` under ``name``, the one place the name is written; a name registered twice is a
        ``ValueError`` (two modules claiming one name)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a built-in {self.kind} name is a non-empty string without ':', got {name!r}")
        if name in self._builtins:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._builtins[name] = obj
        return obj

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a built-in's (entry points are not looked at)."""
        return name in self._builtins

    def get(self, name: str) -> T | None:
        """The built-in called ``name`` (``None`` when there is none; entry points are not looked at)."""
        return self._builtins.get(name)

    def names(self) -> tuple[str, ...]:
        """The built-in names, in registration order."""
        return tuple(self._builtins)

    # ------------------------------------------------------------------------------------------------ entry points
    def entry_points(self, name: str | None = None) -> list[importlib.metadata.EntryPoint]:
        """The installed entry points of this kind's group (those called ``name`` if given); metadata only."""
        return plugins.entry_points(self.group, name)

    def plugins(self) -> dict[str, tuple[PluginDistribution | None, ...]]:
        """The installed plug-ins: name → the distribution(s) exporting it, sorted by name; metadata only, no plug-in
        module is imported.  A name with more than one distribution, or a built-in's name, is listed too:
        :meth:`status` says whether it can be used."""
        found: dict[str, list[PluginDistribution | None]] = {}
        for ep in self.entry_points():
            dists = found.setdefault(ep.name, [])
            dist = distribution_of_entry_point(ep)
            if dist not in dists:
                dists.append(dist)
        return {name: tuple(found[name]) for name in sorted(found)}

    def plugin_names(self) -> list[str]:
        """The installed plug-ins' names that no built-in takes, sorted (what an unknown name's message offers)."""
        return [n for n in self.plugins() if n not in self._builtins]

    def status(self, name: str, distributions: tuple[PluginDistribution | None, ...]) -> str:
        """Whether a listed plug-in (:meth:`plugins`) can be named: ``"ok"``, or ``"refused: <why>"``."""
        if name in self._builtins:
            return "refused: a built-in has this name"
        if len(distributions) > 1:
            return "refused: exported by more than one distribution"
        if ":" in name:
            return "refused: the name contains ':'"
        return "ok"

    def lookup(
        self,
        name: str,
        *,
        clash: EntryPointMessage | None = None,
        shadowed: EntryPointMessage | None = None,
    ) -> importlib.metadata.EntryPoint | None:
        """The entry point ``name`` stands for (``None`` when no installed distribution exports it); metadata only.
        Two distributions exporting it raise ``error(clash(name, eps))``; an entry point taking a built-in's name
        raises ``error(shadowed(name, eps))``.  The messages default to :meth:`clash_message` and
        :meth:`shadowed_message`; a kind passes its own wording."""
        clash = clash or self.clash_message
        shadowed = shadowed or self.shadowed_message
        return plugins.lookup_entry_point(
            self.group,
            name,
            error=self.error,
            clash=lambda eps: clash(name, eps),
            shadowed=(lambda eps: shadowed(name, eps)) if name in self._builtins else None,
        )

    def clash_message(self, name: str, eps: list[importlib.metadata.EntryPoint]) -> str:
        """The default wording of a name exported by more than one distribution."""
        shown = " and ".join(f"{_dist(ep)} ({ep.value!r})" for ep in eps)
        return (
            f"{self.kind} {name!r}: entry point of group {self.group!r} exported by more than one distribution: "
            f"{shown}; uninstall one"
        )

    def shadowed_message(self, name: str, eps: list[importlib.metadata.EntryPoint]) -> str:
        """The default wording of an entry point that takes a built-in's name."""
        return (
            f"{self.kind} {name!r}: entry point of {_dist(eps[0])} ({eps[0].value!r}, group {self.group!r}) has the "
            f"name of a built-in {self.kind}, which always wins; rename the entry point"
        )

    def unknown(self, name: str) -> UnknownNameError:
        """The error for a name that is neither built in nor an installed entry point, naming the known ones."""
        return UnknownNameError(self.kind, name, list(self._builtins), self.plugin_names())
