"""The records of a sweep's studies, opened and checked before Ray starts: :func:`open_records`.  Imports no Ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipelines.config.spaces import Param
from pipelines.records.model import StudyHeader
from pipelines.records.store import RecordsError, StudyRecords, header_of, study_folder

__all__ = ["open_records", "study_header"]


def study_header(cfg, plan, fingerprint) -> StudyHeader:
    """The header a study's records must carry: its key, its protocol fingerprint and its search."""
    return header_of(
        {
            "study": plan.key,
            "dataset": plan.dataset.spec.name,
            "loss": plan.loss.name,
            "fingerprint": fingerprint.to_json(),
            "trials": cfg.protocol.trials if plan.searched else 1,
            "reproductions": cfg.protocol.reproductions,
            "searched": {k: _param(p) for k, p in sorted(plan.searched.items())},
        }
    )


def _param(p: Param) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(p).items()}


def open_records(cfg, plans, fingerprints) -> dict[str, StudyRecords]:
    """Every study's records in ``cfg.records`` (none yet for a new study: nothing is written before its first
    record), by study key; {} without a records folder.
    Raises :class:`pipelines.records.store.RecordsError` for the first record that cannot be continued from."""
    if not cfg.records:
        return {}
    root = Path(cfg.records)
    if root.exists() and not root.is_dir():
        raise RecordsError(f"{root}: not a folder")
    return {
        p.key: StudyRecords.open(
            study_folder(root, p.dataset.spec.name, p.loss.name), study_header(cfg, p, fingerprints[p.key])
        )
        for p in plans
    }
