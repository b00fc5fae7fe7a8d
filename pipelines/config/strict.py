"""The base of every config model (the sweep's and the re-evaluation's): one set of validation rules."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """Base of every config section: unknown keys rejected, no type coercion (``"5"`` is not 5, ``true`` is not
    1), no NaN/inf, immutable; a YAML ``null`` means "the default"."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        allow_inf_nan=False,
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data
