"""The ``datasets`` of a sweep config: generated data, the Omniglot zips, prepared parquet shards, an image folder,
a CSV listing (one pydantic model each, told apart by ``kind``)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from pipelines.config.errors import FieldError
from pipelines.config.fields import DATASET_KINDS, Name, Seed, Uri, absolute, local_or_s3
from pipelines.config.strict import StrictModel

__all__ = [
    "DATASET_KINDS",
    "MAX_SYNTHETIC_BYTES",
    "DatasetSpec",
    "SyntheticDataset",
    "OmniglotDataset",
    "FolderDataset",
    "ParquetDataset",
    "CsvDataset",
]

#: Synthetic data is generated in memory (``num_classes × per_class`` H×W×3 uint8 images).
MAX_SYNTHETIC_BYTES = 4 << 30


class _DatasetBase(StrictModel):
    name: Name | None = None
    """The MLflow ``dataset`` tag (default: the kind)."""
    classes: int | None = Field(None, ge=2, le=10**7)
    """Keep only the first N sorted classes (quick runs on big datasets; null = all)."""


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


class _PathDataset(_DatasetBase):
    path: Uri
    image_size: int = Field(227, ge=8, le=1024)
    """Side of the protocol transforms' output (the reality check: 227 crops of 256 resizes; 16–32 for smoke runs)."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        # Absolute, because Ray workers run in their own working directory (and may open shards lazily).
        return absolute(local_or_s3(v))


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


DatasetSpec = Annotated[
    Union[SyntheticDataset, OmniglotDataset, FolderDataset, ParquetDataset, CsvDataset], Field(discriminator="kind")
]
