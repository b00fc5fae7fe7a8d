"""What every kind of plugin (losses, trunks, dataset kinds) shares: finding entry points, the installed
distribution behind a plugin, and importing ``module:attribute`` with one-line errors that point at the plugin's own
code.

* :func:`entry_points` / :func:`distinct_entry_points` — the entry points of a group (metadata only, nothing of
  the plugins is imported), and those left once the same distribution seen twice on ``sys.path`` counts once.
* :class:`PluginDistribution` — an installed distribution, how it was installed, and the pip requirement pinning it
  (only one installed from an index is pinned by name);
  :func:`distribution_of_entry_point`, :func:`distribution_of_module` and :func:`installed_distribution` find it.
* :data:`IMPORT_PATH` — the ``package.module:attr`` syntax; :func:`load_object` imports and looks one up, raising
  :class:`PluginImportError` / :class:`PluginAttributeError` (both :class:`PluginError`, a ``ValueError``).
* :func:`one_line` / :func:`raised_at` — a plugin's exception as ``Type: message`` and the ``file:line`` of the
  plugin's code that raised it.
* :func:`lookup_entry_point` — the one entry point a plugin name stands for, refusing a name exported by two
  distributions or taken by a built-in; every kind of plugin looks its names up through it.
* :class:`PluginError` and its kinds, :class:`LossPluginError`, :class:`TrunkPluginError` and
  :class:`DatasetPluginError`: every error a plugin causes is one of them (a ``ValueError`` with a one-line message).
* The contracts, in code: :class:`LossFactory` (what a loss plugin names), :class:`TrunkFactory` and
  :class:`TrunkModule` (what a trunk plugin names and what it returns).  The signature probes of each kind read their
  parameter names from these protocols (:func:`keyword_parameters`); a dataset kind's,
  :class:`dml_core.datasets.registry.DatasetLoader`, lives beside its registry, since it returns a
  ``dml_core.data.ImageTable``.

Each kind's names (built-ins and entry points) are kept by a :class:`dml_core.registry.Registry`, which looks entry
points up through :func:`lookup_entry_point`.  The wording of the messages a user sees stays with each kind of
plugin (``dml_core.losses.resolve``, ``dml_core.trunks.plugins``, ``dml_core.datasets.registry``): the errors raised
here carry what went wrong as attributes for them to word it.  This module imports nothing of ``dml_core`` (every
plugin kind imports it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing this module stays free of torch
    from torch import Tensor, nn

__all__ = [
    "IMPORT_PATH",
    "DISTRIBUTION_ORIGINS",
    "PluginDistribution",
    "PluginError",
    "PluginImportError",
    "PluginAttributeError",
    "LossPluginError",
    "TrunkPluginError",
    "DatasetPluginError",
    "LossFactory",
    "TrunkFactory",
    "TrunkModule",
    "keyword_parameters",
    "entry_points",
    "distinct_entry_points",
    "lookup_entry_point",
    "distribution_of_entry_point",
    "distribution_of_module",
    "installed_distribution",
    "load_object",
    "one_line",
    "raised_at",
]

#: ``package.module:attr`` (the attribute may be dotted: ``module:Class.factory``), as in setuptools entry points;
#: each part a Python identifier (letters, digits and ``_``, not starting with a digit; non-ASCII letters included).
IMPORT_PATH = re.compile(r"(?!\d)\w+(?:\.(?!\d)\w+)*:(?!\d)\w+(?:\.(?!\d)\w+)*")


#: How a distribution came to be importable (:attr:`PluginDistribution.origin`).
DISTRIBUTION_ORIGINS = ("index", "direct", "unmanaged")


@dataclass(frozen=True)
class PluginDistribution:
    """The installed distribution that provides a plugin (what a registered model must require).

    ``origin`` says how it was installed, from its metadata (PEP 610): ``"index"`` — a ``*.dist-info`` without
    ``direct_url.json``, as installers leave a distribution they took from a package index; ``"direct"`` — a
    ``*.dist-info`` with ``direct_url.json``: an editable install, a local folder or archive, a VCS or URL;
    ``"unmanaged"`` — ``*.egg-info`` metadata, which setuptools writes into a source folder (a build or a legacy
    ``setup.py develop`` leaves it beside the code): no installer recorded where it came from.  ``metadata_dir``: the
    metadata folder (``None`` when not known).  Neither takes part in equality."""

    name: str
    version: str
    origin: str = field(default="index", compare=False)
    metadata_dir: str | None = field(default=None, compare=False, repr=False)

    @property
    def from_index(self) -> bool:
        """Whether an installer took this distribution from a package index."""
        return self.origin == "index"

    @property
    def requirement(self) -> str | None:
        """The pip requirement pinning this distribution on an index, ``"name==version"`` — ``None`` unless it was
        installed from one: a local build pinned by name would install whatever an index serves under that name."""
        return f"{self.name}=={self.version}" if self.from_index else None

    @classmethod
    def of(cls, dist: importlib.metadata.Distribution, name: str | None = None) -> PluginDistribution:
        """The :class:`PluginDistribution` of an ``importlib.metadata`` distribution, its origin read from its
        metadata files."""
        if dist.read_text("METADATA") is None:  # *.egg-info: PKG-INFO, written by setuptools, not by an installer
            origin = "unmanaged"
        elif dist.read_text("direct_url.json") is not None:
            origin = "direct"
        else:
            origin = "index"
        path = getattr(dist, "_path", None)  # PathDistribution's metadata folder (no public accessor)
        return cls(dist.name or name or "", dist.version, origin, str(path) if path is not None else None)

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


class PluginError(ValueError):
    """A plugin cannot be used; the message is one line naming the plugin and what is wrong with it."""


class PluginImportError(PluginError):
    """The plugin's module does not import.  ``cause`` is the plugin's own exception; ``missing`` tells that the
    module itself (or a package above it) is not installed, rather than the module failing while it imports."""

    def __init__(self, message: str, *, module: str, cause: BaseException, missing: bool):
        super().__init__(message)
        self.module = module
        self.cause = cause
        self.missing = missing


class PluginAttributeError(PluginError):
    """``owner`` (``"module"`` or ``"module:Outer"``) has no attribute ``part`` (``cause`` is ``None``), or reading it
    raised ``cause`` (a module ``__getattr__`` or a property of the plugin)."""

    def __init__(self, message: str, *, owner: str, part: str, cause: BaseException | None):
        super().__init__(message)
        self.owner = owner
        self.part = part
        self.cause = cause


class LossPluginError(PluginError):
    """A loss from outside this package (import path or entry point) cannot be used; the message is one line
    that names the loss and what is wrong with it."""


class TrunkPluginError(PluginError):
    """A trunk from user code (import path or entry point) cannot be used; the message is one line that names the
    trunk and what is wrong with it."""


class DatasetPluginError(PluginError):
    """A dataset kind from an installed entry point cannot be used (does not import, is no loader, refuses the
    arguments it is given, fails or returns something else than an ``ImageTable``); the message is one line that
    names the dataset kind and what is wrong with it."""


# --------------------------------------------------------------------------------------------------- contracts
@runtime_checkable
class LossFactory(Protocol):
    """What a loss plugin's import path or entry point names: a function or ``nn.Module`` class called with the
    class count and embedding width as keywords, plus the loss's hyperparameters, returning a module for which
    ``loss(embeddings, labels)`` is a scalar tensor (``docs/plugins.md``, "The loss object")."""

    def __call__(self, *, num_classes: int, embedding_dim: int, **hyperparameters: Any) -> nn.Module: ...


@runtime_checkable
class TrunkModule(Protocol):
    """What a trunk factory returns: an ``nn.Module`` mapping (B, 3, H, W) images to a (B, C, H', W') feature map,
    with C as an int ``feature_dim`` (timm's ``num_features`` is read when ``feature_dim`` is absent)."""

    feature_dim: int

    def __call__(self, images: Tensor) -> Tensor: ...


@runtime_checkable
class TrunkFactory(Protocol):
    """What a trunk plugin's import path or entry point names: a callable with no required argument returning a
    :class:`TrunkModule`; when it takes ``pretrained``, it is given the local weights file (or ``None``) and loads
    it itself (``docs/trunks.md``)."""

    def __call__(self, pretrained: str | None = None) -> nn.Module: ...


def keyword_parameters(protocol: type) -> tuple[str, ...]:
    """The named parameters of a call protocol's ``__call__``, in order (``self`` and ``**kwargs`` left out): what
    the signature probes require of, or offer to, a plugin's callable."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(protocol.__call__).parameters
    return tuple(n for n, p in params.items() if n != "self" and p.kind in named)


# --------------------------------------------------------------------------------------------------- entry points
def entry_points(group: str, name: str | None = None) -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of ``group`` (those called ``name`` if given).  Reads distribution metadata only:
    no plugin module is imported."""
    # Looked up on the module at call time, so that a test can replace importlib.metadata.entry_points.
    found = importlib.metadata.entry_points(group=group)
    return [ep for ep in found if name is None or ep.name == name]


def distinct_entry_points(eps: Iterable[importlib.metadata.EntryPoint]) -> list[importlib.metadata.EntryPoint]:
    """``eps`` in order, each (distribution, value) once: the same distribution found twice on ``sys.path`` (two
    site directories holding it) counts once.  More than one left for a name is a clash between distributions."""
    out, seen = [], set()
    for ep in eps:
        key = (distribution_of_entry_point(ep), ep.value)
        if key not in seen:
            seen.add(key)
            out.append(ep)
    return out


def lookup_entry_point(
    group: str,
    name: str,
    *,
    error: type[PluginError],
    clash: Callable[[list[importlib.metadata.EntryPoint]], str],
    shadowed: Callable[[list[importlib.metadata.EntryPoint]], str] | None = None,
) -> importlib.metadata.EntryPoint | None:
    """The entry point of ``group`` called ``name`` (``None`` when no installed distribution exports it); metadata
    only, nothing is imported.  ``shadowed``, given when ``name`` is a built-in's: any entry point of that name is
    refused with ``error(shadowed(eps))``.  More than one distribution exporting it is ``error(clash(eps))``.  The
    wording stays with each kind of plugin."""
    eps = distinct_entry_points(entry_points(group, name))
    if shadowed is not None and eps:
        raise error(shadowed(eps))
    if len(eps) > 1:
        raise error(clash(eps))
    return eps[0] if eps else None


# --------------------------------------------------------------------------------------------------- distributions
def distribution_of_entry_point(ep: importlib.metadata.EntryPoint) -> PluginDistribution | None:
    """The distribution that declares ``ep`` (``None`` when importlib does not tell)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return PluginDistribution.of(dist)


def installed_distribution(name: str) -> PluginDistribution | None:
    """The installed distribution called ``name`` (``None`` when there is none)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return PluginDistribution.of(dist, name)


_PKG_DISTS: tuple[tuple[str, ...], dict[str, list[str]]] | None = None


def _packages_distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` (top-level module -> distributions), deduplicated and cached
    for the current ``sys.path`` (it reads every installed distribution's file list: slow)."""
    global _PKG_DISTS
    key = tuple(sys.path)
    if _PKG_DISTS is None or _PKG_DISTS[0] != key:
        mapping = {
            top: list(dict.fromkeys(names)) for top, names in importlib.metadata.packages_distributions().items()
        }
        _PKG_DISTS = (key, mapping)
    return _PKG_DISTS[1]


def distribution_of_module(module_name: str) -> PluginDistribution | None:
    """The installed distribution that provides ``module_name`` (``None`` for a module outside any), from the
    installed file lists.  A namespace package shared by several distributions resolves to the one shipping the
    module itself."""
    names = _packages_distributions().get(module_name.split(".")[0]) or []
    if len(names) > 1:
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
        dist = installed_distribution(candidate)
        if dist is not None:
            return dist
    return None


# --------------------------------------------------------------------------------------------------- one-line errors
_IMPORTLIB_DIR = os.path.normcase(os.path.dirname(os.path.abspath(importlib.__file__)))
#: Frames in this package are skipped too: an error dml_core raises on a plugin's behalf (a bad ``loss_metadata``
#: declaration, a bad ``Preprocessing``) is reported at the plugin's line that made the call.
_DML_CORE_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__)))


def one_line(exc: BaseException) -> str:
    """``"Type: message"`` on one line (white space folded); ``"Type"`` for an exception without a message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raised_at(exc: BaseException, *, labelled: bool = False) -> str:
    """``" (file:line)"`` of the innermost frame of ``exc`` in the plugin's own code — neither importlib's machinery
    nor ``dml_core`` — or ``""`` when there is none (a module that is not installed).  A ``SyntaxError`` names the
    offending line itself.  ``labelled``: ``" (raised at file:line)"``, and ``" (at file:line)"`` for a
    ``SyntaxError`` (which names a line of source, not a frame that raised)."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" ({'at ' if labelled else ''}{exc.filename}:{exc.lineno})"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>: no file to open
            continue
        path = os.path.normcase(os.path.abspath(frame.filename))
        if path.startswith((_IMPORTLIB_DIR + os.sep, _DML_CORE_DIR + os.sep)):
            continue
        return f" ({'raised at ' if labelled else ''}{frame.filename}:{frame.lineno})"
    return ""


def load_object(module: str, attr: str, *, what: str) -> object:
    """``module`` imported and ``attr`` (dotted: ``Class.factory``) looked up in it.  ``what`` names the plugin at
    the start of an error message (``"loss 'circle'"``).

    Raises :class:`PluginImportError` when the module does not import (whatever the plugin raised, with the
    ``file:line`` it came from) and :class:`PluginAttributeError` when an attribute is missing or reading it fails;
    the plugin's exception is never chained, so the error prints as its one-line message.
    """
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # whatever the plugin raises, reported in one line
        missing = (
            isinstance(e, ModuleNotFoundError)
            and e.name is not None
            and (module == e.name or module.startswith(e.name + "."))
        )
        message = (
            f"{what}: cannot import module {module!r} ({one_line(e)}): not installed or not on sys.path"
            if missing
            else f"{what}: cannot import module {module!r}: {one_line(e)}{raised_at(e)}"
        )
        raise PluginImportError(message, module=module, cause=e, missing=missing) from None
    parts = attr.split(".")
    for i, part in enumerate(parts):
        owner = module if i == 0 else f"{module}:{'.'.join(parts[:i])}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginAttributeError(
                f"{what}: {owner!r} has no attribute {part!r}", owner=owner, part=part, cause=None
            ) from None
        except Exception as e:  # a module __getattr__ or property of the plugin's
            raise PluginAttributeError(
                f"{what}: reading {part!r} of {owner!r} failed: {one_line(e)}{raised_at(e)}",
                owner=owner,
                part=part,
                cause=e,
            ) from None
    return obj
