"""Dataset kinds — what a sweep config's ``datasets[].kind`` names — in one registry, :data:`DATASET_KIND_REGISTRY`
(a :class:`dml_core.registry.Registry`, the shape the losses' and the trunks' share).

The built-in kinds are registered here, each with the loader that reads its rows, by :func:`_builtin` — the one place
a kind's name is written: the sweep config validates ``kind:`` against this table and ``dmlrc list`` lists it.  A
plug-in is an entry point of the group ``dml_reality_check.datasets`` naming a :class:`DatasetLoader` (the contract,
in code): called with the dataset entry's ``path`` and ``params`` as keywords, it returns an ``ImageTable``
(``docs/plugins.md``, "Dataset kinds").

:func:`resolve_dataset_kind` turns a name into a :class:`DatasetKind` — a built-in's never reaches the entry points,
a plug-in's module is imported then and only then — and :func:`load_dataset` reads a dataset of any kind.  Importing
this module loads neither torch nor pyarrow: each built-in loader imports its reader when it is called, so that a
config is checked against this table without paying for them.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from dml_core.plugins import (
    DatasetPluginError,
    PluginDistribution,
    PluginError,
    distribution_of_entry_point,
    keyword_parameters,
    load_object,
    one_line,
    raised_at,
)
from dml_core.registry import Registry, UnknownNameError

if TYPE_CHECKING:  # annotations only: importing this module stays free of torch and pyarrow
    from dml_core.data import ImageTable
    from dml_core.shards import ShardedTable

__all__ = [
    "ENTRY_POINT_GROUP",
    "DATASET_KIND_REGISTRY",
    "DatasetKind",
    "DatasetLoader",
    "DatasetPluginError",
    "UnknownNameError",
    "resolve_dataset_kind",
    "load_dataset",
    "builtin_dataset_kinds",
    "list_plugin_dataset_kinds",
]

#: Entry-point group through which an installed distribution offers dataset kinds (``docs/plugins.md``).
ENTRY_POINT_GROUP = "dml_reality_check.datasets"

_Loader = TypeVar("_Loader", bound=Callable[..., Any])


@runtime_checkable
class DatasetLoader(Protocol):
    """What a dataset-kind plugin's entry point names: a callable given the dataset entry's ``path`` (an absolute
    local path or an ``s3://`` URI) and the entry's ``params`` as keywords, returning the dataset's rows as a
    :class:`dml_core.data.ImageTable` (one row per image: encoded bytes, a file path or an array, and an int label),
    as the built-in kinds' loaders do (``docs/plugins.md``, "Dataset kinds")."""

    def __call__(self, *, path: str, **params: Any) -> ImageTable: ...


@dataclass(frozen=True)
class DatasetKind:
    """A resolved dataset kind.  ``loader`` reads a dataset of this kind: called with its arguments as keywords, it
    returns the rows (an ``ImageTable``; a ``ShardedTable`` for the built-in ``parquet``).  ``origin``:
    ``"builtin"`` or ``"entry_point"``; ``ref``: the loader's ``module:attribute``, for messages;
    ``distribution``: the installed distribution of a plug-in (``None`` for built-ins)."""

    name: str
    loader: Callable[..., Any]
    ref: str
    origin: str = "builtin"
    distribution: PluginDistribution | None = None

    @property
    def description(self) -> str:
        """The first paragraph of the loader's docstring, on one line (what ``dmlrc list`` can show)."""
        doc = inspect.getdoc(self.loader) or ""
        return " ".join(doc.split("\n\n")[0].split())

    def check(self, arguments: Mapping[str, Any]) -> None:
        """Whether the loader takes ``arguments`` as keywords — each required parameter given, none it does not
        take; a :class:`DatasetPluginError` naming the kind otherwise (a config is checked with it before anything
        loads)."""
        try:
            sig = inspect.signature(self.loader)
        except (TypeError, ValueError):  # no introspectable signature (a C callable): the call itself will tell
            return
        try:
            sig.bind(**arguments)
        except TypeError as e:
            raise DatasetPluginError(f"dataset kind {self.name!r}: {self.ref}: {e}") from None

    def load(self, **arguments: Any) -> ImageTable | ShardedTable:
        """The dataset's rows.  A plug-in's loader is checked (:meth:`check`) and its result must be an
        ``ImageTable``; whatever it raises becomes one :class:`DatasetPluginError` line with the file:line of the
        plug-in's code (a ``ValueError``: what a dataset reader raises for broken data)."""
        if self.origin == "builtin":
            return self.loader(**arguments)
        self.check(arguments)
        try:
            table = self.loader(**arguments)
        except Exception as e:  # whatever the plug-in raises, reported in one line
            raise DatasetPluginError(
                f"dataset kind {self.name!r}: {self.ref}() raised {one_line(e)}{raised_at(e, labelled=True)}"
            ) from None
        # dml_core.data imports torch: only a loaded dataset is checked against it
        from dml_core.data import ImageTable

        if not isinstance(table, ImageTable):
            raise DatasetPluginError(
                f"dataset kind {self.name!r}: {self.ref}() returned a {type(table).__name__}, not a "
                "dml_core.data.ImageTable"
            )
        return table


#: The built-in dataset kinds (name -> :class:`DatasetKind`, in the order a config error lists them) and the entry
#: points of :data:`ENTRY_POINT_GROUP`.
DATASET_KIND_REGISTRY: Registry[DatasetKind] = Registry("dataset kind", ENTRY_POINT_GROUP, DatasetPluginError)


def _builtin(name: str) -> Callable[[_Loader], _Loader]:
    """Decorator registering a built-in kind's loader under ``name``, the one place the name is written."""

    def deco(loader: _Loader) -> _Loader:
        ref = f"{loader.__module__}:{loader.__qualname__}"
        DATASET_KIND_REGISTRY.register(name, DatasetKind(name, loader, ref))
        return loader

    return deco


# ------------------------------------------------------------------------------------------------ built-in kinds
@_builtin("synthetic")
def _synthetic(*, num_classes: int, per_class: int, image_size: int, seed: int = 0) -> ImageTable:
    """Generated compositional toy classes (``dml_core.data.synthetic``)."""
    # dml_core.data imports torch: read when a dataset is generated, not when a config names the kind
    from dml_core.data import synthetic

    return synthetic(num_classes, per_class, image_size, seed)


@_builtin("omniglot")
def _omniglot(*, path: str | os.PathLike) -> ImageTable:
    """The Omniglot zips (``path``: the folder holding them; ``dml_core.data.read_omniglot``)."""
    # dml_core.data imports torch: read when a dataset is loaded, not when a config names the kind
    from dml_core.data import read_omniglot

    return read_omniglot(path)


@_builtin("parquet")
def _parquet(*, path: str | os.PathLike) -> ShardedTable:
    """Shards prepared by ``dmlrc data prepare`` (``path``: local folder, manifest.json or s3:// URI)."""
    # dml_core.data imports torch (and the shards pyarrow): read when a dataset is loaded
    from dml_core.data import read_parquet_manifest

    return read_parquet_manifest(path)


@_builtin("folder")
def _folder(*, path: str | os.PathLike) -> ImageTable:
    """An image folder (``path``: root with one sub-folder per class; ``dml_core.datasets.folder``)."""
    # the reader imports pyarrow (its records are dml_core.shards'): read when a dataset is loaded
    from dml_core.datasets.folder import read_image_folder

    return read_image_folder(path)


@_builtin("csv")
def _csv(*, path: str, root: str | None = None) -> ImageTable:
    """A CSV listing ``path,label`` (``root``: the folder its paths are relative to; ``dml_core.datasets.csv``)."""
    # the reader imports pyarrow (its records are dml_core.shards'): read when a dataset is loaded
    from dml_core.datasets.csv import read_csv_dataset

    return read_csv_dataset(path, root=root)


# ------------------------------------------------------------------------------------------------ resolving
#: What the contract passes every plug-in loader by keyword: ("path",).
_LOADER_KEYWORDS = keyword_parameters(DatasetLoader)


def _check_loader(obj: object, where: str) -> DatasetLoader:
    """``obj`` as a :class:`DatasetLoader`: callable, taking ``path`` by keyword."""
    if not isinstance(obj, DatasetLoader):
        raise DatasetPluginError(
            f"{where}: is a {type(obj).__name__}, not a dataset loader called as loader(path=..., **params)"
        )
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # no introspectable signature: the call will tell
        return obj
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return obj
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [n for n in _LOADER_KEYWORDS if n not in params or params[n].kind not in keyword]
    if missing:
        raise DatasetPluginError(
            f"{where}: does not take {' and '.join(missing)} as a keyword argument; a dataset loader is called as "
            "loader(path=..., **params)"
        )
    return obj


def _plugin_kind(name: str) -> DatasetKind:
    """The dataset kind an installed entry point offers under ``name``, its loader imported and checked."""
    ep = DATASET_KIND_REGISTRY.lookup(name)
    if ep is None:
        raise DATASET_KIND_REGISTRY.unknown(name)
    dist = distribution_of_entry_point(ep)
    where = f"dataset kind {name!r} (entry point {ep.value!r} of {dist or '(unknown distribution)'})"
    if not ep.attr:
        raise DatasetPluginError(f"{where}: names a module, not a dataset loader; the value must be 'module:attribute'")
    try:
        obj = load_object(ep.module, ep.attr, what=where)
    except PluginError as e:
        raise DatasetPluginError(str(e)) from None
    loader = _check_loader(obj, where)
    return DatasetKind(name, loader, f"{ep.module}:{ep.attr}", "entry_point", dist)


def resolve_dataset_kind(name: str) -> DatasetKind:
    """The :class:`DatasetKind` of ``name``: a built-in (the entry points are not looked at) or an installed entry
    point of :data:`ENTRY_POINT_GROUP` (its module imported now).  An unknown name is an
    :class:`~dml_core.registry.UnknownNameError` naming the known ones, a plug-in that cannot be used a
    :class:`DatasetPluginError`; both are ``ValueError`` with one line."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a dataset kind is a non-empty string, got {name!r}")
    builtin = DATASET_KIND_REGISTRY.get(name)
    if builtin is not None:
        return builtin
    return _plugin_kind(name)


def load_dataset(kind: str, **arguments: Any) -> ImageTable | ShardedTable:
    """A dataset of ``kind`` read by its loader (:meth:`DatasetKind.load`): ``load_dataset("folder", path=...)``,
    ``load_dataset("synthetic", num_classes=8, per_class=4, image_size=16)``, or a plug-in's
    ``load_dataset("mykind", path=..., **params)``."""
    return resolve_dataset_kind(kind).load(**arguments)


def builtin_dataset_kinds() -> tuple[str, ...]:
    """The built-in dataset kinds, in registration order: the one table of their names."""
    return DATASET_KIND_REGISTRY.names()


def list_plugin_dataset_kinds() -> dict[str, tuple[PluginDistribution | None, ...]]:
    """Installed dataset-kind plug-ins: name -> the distribution(s) exporting it, sorted; metadata only, no plug-in
    module is imported."""
    return DATASET_KIND_REGISTRY.plugins()
