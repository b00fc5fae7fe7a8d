"""The ``tracking`` of a sweep config: the MLflow tracking URI, experiment and outage timeout
(:class:`TrackingSpec`)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from pipelines.config.errors import ConfigError
from pipelines.config.fields import Uri
from pipelines.config.strict import StrictModel
from pipelines.config.uris import check_tracking_uri, shown

__all__ = ["TrackingSpec"]


def _tracking(v: str) -> str:
    try:
        return check_tracking_uri(v, "")
    except ConfigError as e:
        raise ValueError(e.problem) from None


class TrackingSpec(StrictModel):
    """MLflow: ``uri`` null = ``$MLFLOW_TRACKING_URI`` if set, else a sqlite DB inside the sweep's local directory;
    ``experiment`` null = the sweep name."""

    uri: Annotated[Uri, AfterValidator(_tracking)] | None = None
    """http(s)://host[:port], sqlite:///path.db or postgresql[+psycopg2]://user@host[:port]/database."""
    experiment: str | None = Field(None, max_length=256)
    outage_timeout_s: float = Field(300.0, ge=10.0, le=900.0)
    """How long the tracking server (or PostgreSQL store) may stay unreachable mid-sweep before the sweep stops with
    one message and its state kept for `--resume` (a shorter outage is ridden out: MLflow's HTTP retries are set to
    outlast it).  At most 900 s: MLflow allows 10 retries of at most 120 s back-off each."""

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        if v is not None and re.search(r"[\x00-\x1f\x7f]", v):
            raise ValueError(
                f"{shown(v)} contains a control character (a newline or tab breaks the printed "
                "commands and the MLflow UI)"
            )
        return v
