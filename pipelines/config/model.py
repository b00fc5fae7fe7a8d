"""The ``model`` of a sweep config: the trunk (built-in, ``timm:``, plugin), pooling, LayerNorm, embedding width and
pretrained weights (:class:`ModelSpec`, the arguments of :func:`dml_core.models.build_model`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from dml_core.models import parse_pooling
from dml_core.trunks import check_trunk
from pipelines.config.fields import Uri, absolute, local_or_s3, plugin_exited
from pipelines.config.strict import StrictModel
from pipelines.config.uris import shown

__all__ = ["ModelSpec", "GEM_P_MAX"]

#: The largest GeM power a config may set (``model.pooling: gem:P``).
GEM_P_MAX = 16.0


class ModelSpec(StrictModel):
    """``dml_core.models.build_model`` arguments.  ``pooling``/``layer_norm`` null = the protocol's (or, with
    ``recipe: paper``, the loss paper's) recipe."""

    trunk: str = Field("tiny", min_length=1, max_length=256)
    """tiny | resnet18 | resnet50 | googlenet | bninception | timm:<name> | an installed plugin's trunk (entry-point
    group dml_reality_check.trunks) | an import path package.module:attribute (docs/trunks.md)."""
    pooling: str | None = Field(None, max_length=64)
    """avg | max | avg+max | gem | gem:P | kmax:K (null = the recipe's)."""
    layer_norm: bool | None = None
    embedding_dim: int = Field(128, ge=2, le=4096)
    pretrained: Uri | None = None
    """The trunk's weights: a local file or s3:// URI, read where each model is built (weights_only=True).
    Registered models never need it: their own weights are logged with them."""
    freeze_bn: bool = True

    @field_validator("trunk")
    @classmethod
    def _trunk(cls, v: str) -> str:
        try:
            check_trunk(v)  # its ValueError names the trunk and what is known
        except SystemExit as e:  # a plugin's module that calls sys.exit() when imported
            raise ValueError(plugin_exited(e, f"trunk {v!r}")) from None
        return v

    @field_validator("pooling")
    @classmethod
    def _pooling(cls, v: str | None) -> str | None:
        if v is not None:
            kind, arg = parse_pooling(v)  # its ValueError says what is accepted
            if kind == "gem" and arg is not None and arg > GEM_P_MAX:  # gem always has its p
                raise ValueError(
                    f"{shown(v)}: GeM's p must be <= {GEM_P_MAX:g} (x^p underflows or overflows float32 beyond: the "
                    "embeddings stop depending on the image); GeM with a large p is max pooling: use 'max'"
                )
        return v

    @field_validator("pretrained")
    @classmethod
    def _pretrained(cls, v: str | None) -> str | None:
        if v is None:
            return v
        # A local file is named absolutely so that every process on this machine (or a shared mount) finds it.
        return absolute(local_or_s3(v))

    def kwargs(self, recipe: Any | None = None) -> dict[str, Any]:
        """Arguments for ``build_model``: explicit values win over the loss's :class:`ModelRecipe`."""
        pooling = self.pooling or (recipe.pooling if recipe is not None else "avg")
        layer_norm = self.layer_norm if self.layer_norm is not None else bool(recipe.layer_norm if recipe else False)
        return {
            "trunk": self.trunk,
            "pooling": pooling,
            "layer_norm": layer_norm,
            "embedding_dim": self.embedding_dim,
            "pretrained": self.pretrained,
            "freeze_bn": self.freeze_bn,
        }
