"""The Tune callbacks that write a study's record as each search trial or reproduction finishes (on the driver,
in the study's thread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import tune

from pipelines.names import REPRODUCTION
from pipelines.records.model import StudyHeader
from pipelines.records.rows import reproduction_record, trial_record
from pipelines.records.store import StudyRecords

__all__ = ["RecordTrials", "RecordReproductions"]


def _row(trial) -> dict[str, Any]:
    row = dict(trial.last_result or {})
    row["config"], row["trial_id"] = dict(trial.config), trial.trial_id
    return row


class RecordTrials(tune.Callback):
    """Writes a search trial's record when Tune completes it (a pruned trial's too: its last rung is its value).
    Holds only the folder and header (picklable, restored with its Tuner): the folder is read again for each record,
    so a restored search numbers its trials after those recorded since."""

    def __init__(self, folder: Path, header: StudyHeader) -> None:
        self.folder, self.header = folder, header

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        records = StudyRecords.open(self.folder, self.header)
        if records.has_trial(trial.trial_id):
            return
        row = _row(trial)
        records.add_trial(trial_record(row, self.header.study, self.header.fingerprint["hash"], len(records.trials)))


class RecordReproductions(tune.Callback):
    """Writes a reproduction's record when Tune completes it (with test metrics: a reproduction that finished ok)."""

    def __init__(self, folder: Path, header: StudyHeader, params: dict[str, Any]) -> None:
        self.folder, self.header, self.params = folder, header, dict(params)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        row = _row(trial)
        if REPRODUCTION not in row or row.get("status") != "ok":
            return
        records = StudyRecords.open(self.folder, self.header)
        records.add_reproduction(
            reproduction_record(row, self.header.study, self.header.fingerprint["hash"], self.params)
        )
