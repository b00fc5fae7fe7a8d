"""The ``datasets`` of a sweep config: generated data, the Omniglot zips, prepared parquet shards, an image folder,
a CSV listing (one pydantic model each), or a dataset kind of an installed plug-in, told apart by ``kind``.

Which kinds exist is :data:`dml_core.datasets.registry.DATASET_KIND_REGISTRY`'s to say: ``kind:`` is validated
against it (:func:`_dataset_tag`), each built-in kind it registers has one model here (checked when this module is
imported), and any other name an installed distribution exports as a dataset kind is a :class:`PluginDataset`.
Each model hands its loader the arguments of :meth:`loader_arguments`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from dml_core.datasets.registry import DATASET_KIND_REGISTRY, resolve_dataset_kind
from pipelines.config.errors import FieldError
from pipelines.config.fields import DATASET_KINDS, Name, Seed, Uri, absolute, local_or_s3, plugin_exited
from pipelines.config.strict import StrictModel

__all__ = [
    "DATASET_KINDS",
    "MAX_SYNTHETIC_BYTES",
    "PLUGIN_TAG",
    "DatasetSpec",
    "SyntheticDataset",
    "OmniglotDataset",
    "FolderDataset",
    "ParquetDataset",
    "CsvDataset",
    "PluginDataset",
    "dataset_models",
]

#: The union tag of a plug-in's dataset entry (not an identifier, so an error's location leaves it out).
PLUGIN_TAG = "plug-in"

#: Synthetic data is generated in memory (``num_classes × per_class`` H×W×3 uint8 images).
MAX_SYNTHETIC_BYTES = 4 << 30


class _DatasetBase(StrictModel):
    name: Name | None = None
    """The MLflow ``dataset`` tag (default: the kind)."""
    classes: int | None = Field(None, ge=2, le=10**7)
    """Keep only the first N sorted classes (quick runs on big datasets; null = all)."""

    def loader_arguments(self) -> dict[str, Any]:
        """The keywords of this kind's loader (:func:`dml_core.datasets.registry.load_dataset`): the entry's own
        fields, without ``name``, ``classes`` and the transforms' ``image_size``."""
        raise NotImplementedError


class SyntheticDataset(_DatasetBase):
    """Generated compositional toy classes (``dml_core.data.synthetic``)."""

    kind: Literal["synthetic"]
    num_classes: int = Field(ge=2, le=100_000)
    per_class: int = Field(ge=2, le=100_000)
    image_size: int = Field(16, ge=8, le=512)
    """Side of the generated images in pixels."""
    seed: Seed | None = None
    """Generator seed (default: the sweep's ``seed``)."""

    @model_validator(mode="after")
    def _fits_in_memory(self):
        nbytes = self.num_classes * self.per_class * self.image_size**2 * 3
        if nbytes > MAX_SYNTHETIC_BYTES:
            raise FieldError(
                "num_classes",
                f"{self.num_classes} classes × {self.per_class} images of "
                f"{self.image_size}² pixels need {nbytes / 2**30:.0f} GiB in memory "
                f"(limit {MAX_SYNTHETIC_BYTES >> 30} GiB)",
            )
        return self

    def loader_arguments(self) -> dict[str, Any]:
        """Generator keywords; ``seed`` once the sweep's has filled it in."""
        out: dict[str, Any] = dict(num_classes=self.num_classes, per_class=self.per_class, image_size=self.image_size)
        if self.seed is not None:
            out["seed"] = self.seed
        return out


class _PathDataset(_DatasetBase):
    path: Uri
    image_size: int = Field(227, ge=8, le=1024)
    """Side of the protocol transforms' output (the reality check: 227 crops of 256 resizes; 16–32 for smoke runs)."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        # Absolute, because Ray workers run in their own working directory (and may open shards lazily).
        return absolute(local_or_s3(v))

    def loader_arguments(self) -> dict[str, Any]:
        """The dataset's location."""
        return {"path": self.path}


class OmniglotDataset(_PathDataset):
    """The Omniglot zips (``path``: the folder holding them)."""

    kind: Literal["omniglot"]

    @field_validator("path")
    @classmethod
    def _local(cls, v: str) -> str:
        if v.startswith("s3://"):
            raise ValueError("the Omniglot zips are read from a local folder (prepare shards for s3://)")
        return v


class FolderDataset(_PathDataset):
    """An image folder (``path``: root with one sub-folder per class)."""

    kind: Literal["folder"]


class ParquetDataset(_PathDataset):
    """Shards prepared by ``dmlrc data prepare`` (``path``: local folder, manifest.json or s3:// URI)."""

    kind: Literal["parquet"]


class CsvDataset(_PathDataset):
    """A CSV listing ``path,label`` (+ optional ``split``, ``query``, ``gallery``, ``class_name``), local or
    ``s3://`` (docs/datasets.md)."""

    kind: Literal["csv"]
    root: Uri | None = None
    """Folder the CSV's paths are relative to (default: the CSV's own folder)."""

    @field_validator("root")
    @classmethod
    def _root(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return absolute(local_or_s3(v))

    def loader_arguments(self) -> dict[str, Any]:
        """The CSV and the folder its paths are relative to."""
        return {"path": self.path, "root": self.root}


class PluginDataset(_PathDataset):
    """A dataset kind of an installed plug-in (an entry point of the group ``dml_reality_check.datasets``;
    docs/plugins.md): its loader reads ``path`` with ``params``."""

    #: The plug-in's name for its kind (never a built-in kind's name).
    kind: str = Field(json_schema_extra={"not": {"enum": list(DATASET_KINDS)}})
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the plug-in's loader besides ``path``."""

    def loader_arguments(self) -> dict[str, Any]:
        """``path`` and the entry's ``params``."""
        return {"path": self.path, **self.params}

    @model_validator(mode="after")
    def _loader_takes_it(self):
        """The plug-in's loader imported and checked now (as a plug-in loss is), and it takes ``params``."""
        if "path" in self.params:
            raise FieldError("params.path", "is the dataset entry's own path: set path: instead")
        try:
            kind = resolve_dataset_kind(self.kind)
        except SystemExit as e:  # a plug-in module that calls sys.exit() when imported: not the sweep's exit
            raise FieldError("kind", plugin_exited(e, f"dataset kind {self.kind!r}")) from None
        except ValueError as e:  # the plug-in's one-line error (DatasetPluginError, an ambiguous name)
            raise FieldError("kind", " ".join(str(e).split())) from None
        try:
            kind.check(self.loader_arguments())
        except ValueError as e:
            raise FieldError("params", " ".join(str(e).split())) from None
        return self


def _model_kind(model: type[_DatasetBase]) -> str:
    """The kind a built-in model validates (its ``kind`` literal)."""
    (kind,) = get_args(model.model_fields["kind"].annotation)
    return str(kind)


def dataset_models() -> dict[str, type[_DatasetBase]]:
    """Built-in kind -> its model (the members of :data:`DatasetSpec` but the plug-ins'), in the registry's order; a
    ``RuntimeError`` when a kind is registered without a model here or a model validates a kind the registry does
    not hold."""
    members = [get_args(tagged)[0] for tagged in get_args(get_args(DatasetSpec)[0])]
    by_kind = {_model_kind(m): m for m in members if m is not PluginDataset}
    if set(by_kind) != set(DATASET_KINDS):
        raise RuntimeError(
            f"the sweep config's dataset models ({', '.join(by_kind)}) are not the registered built-in dataset kinds "
            f"({', '.join(DATASET_KINDS)})"
        )
    return {kind: by_kind[kind] for kind in DATASET_KINDS}


def _dataset_tag(value: Any) -> str | None:
    """Which model validates a dataset entry, by its ``kind`` against the registry: a built-in's own; the plug-in
    model for a name an installed distribution exports (metadata only: the plug-in is imported by its model's
    validator); an unknown name as it is, which pydantic refuses as an unknown kind.  ``None``: no ``kind``."""
    if isinstance(value, dict):
        if "kind" not in value:
            return None
        kind = value["kind"]
    elif isinstance(value, _DatasetBase):
        kind = getattr(value, "kind", None)  # declared by each kind's model, not by their base
    else:  # not a mapping: any built-in model says so
        return DATASET_KINDS[0]
    if not isinstance(kind, str):
        return str(kind)
    if kind in _MODELS:
        return kind
    return PLUGIN_TAG if DATASET_KIND_REGISTRY.entry_points(kind) else kind


def _tag(model: type[_DatasetBase]) -> Tag:
    return Tag(_model_kind(model))


DatasetSpec = Annotated[
    Union[
        Annotated[SyntheticDataset, _tag(SyntheticDataset)],
        Annotated[OmniglotDataset, _tag(OmniglotDataset)],
        Annotated[FolderDataset, _tag(FolderDataset)],
        Annotated[ParquetDataset, _tag(ParquetDataset)],
        Annotated[CsvDataset, _tag(CsvDataset)],
        Annotated[PluginDataset, Tag(PLUGIN_TAG)],
    ],
    Discriminator(_dataset_tag),
]
#: Built-in kind -> model; importing this module fails when they and the registry disagree.
_MODELS = dataset_models()
