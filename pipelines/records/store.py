"""A study's records folder: ``<records>/<dataset>/<loss>/`` with ``study.json`` and one file per finished trial
(``trial-NNN.json``) and reproduction (``reproduction-N.json``).

Reading checks everything before a sweep starts: every file parses and validates (a truncated or hand-edited record
is one error naming the file and the field), every record belongs to the study and carries the header's fingerprint
hash, the trial indices run 0..n-1 without a gap, and the header's fingerprint equals the sweep's (else the first
differing field is named).  Writing never replaces a file: a record is written to a temporary name and linked into
place only if no record of that name exists, so nothing already recorded is lost or overwritten.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipelines.config.errors import ConfigError
from pipelines.records.model import SCHEMA, ReproductionRecord, StudyHeader, TrialRecord
from pipelines.results.fingerprint import Fingerprint, first_difference, shown_value

__all__ = ["RecordsError", "StudyRecords", "study_folder", "read_record", "HEADER"]

#: The study's header file in its records folder.
HEADER = "study.json"
#: Bound on one record's size: a record holds a few curves, never more than a few kB.
_MAX_BYTES = 1 << 20


class RecordsError(ConfigError):
    """A records folder that cannot be continued from: one line naming the file and what is wrong."""

    def __init__(self, message: str):
        super().__init__("records", message)


def study_folder(records: str | os.PathLike, dataset: str, loss: str) -> Path:
    """``<records>/<dataset>/<loss>``; a loss name's ``:`` (``sec:triplet``) becomes ``-`` in the folder's name."""
    return Path(records) / dataset / loss.replace(":", "-")


def _error_text(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def read_record(path: Path, model):
    """One record file parsed and validated as ``model``; any problem is a :class:`RecordsError` naming the file."""
    try:
        if not path.is_file():
            raise RecordsError(f"{path}: not a regular file")
        if path.stat().st_size > _MAX_BYTES:
            raise RecordsError(f"{path}: {path.stat().st_size} bytes, more than a record holds ({_MAX_BYTES})")
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise RecordsError(f"{path}: not a complete JSON record ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise RecordsError(f"{path}: schema {found!r}, expected {SCHEMA!r}")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise RecordsError(f"{path}: {_error_text(e)}") from None


def _dump(model) -> str:
    """Compact JSON, one line (a trial with four 40-point curves is about 3 kB)."""
    return json.dumps(model.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":")) + "\n"


@dataclass
class StudyRecords:
    """The records of one study: read by :meth:`open` (checked against the sweep's fingerprint), written by
    :meth:`add_trial` / :meth:`add_reproduction` as the study goes."""

    folder: Path
    header: StudyHeader
    trials: list[TrialRecord] = field(default_factory=list)
    reproductions: dict[int, ReproductionRecord] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path, header: StudyHeader) -> StudyRecords:
        """The folder's records (none for a new folder: nothing is written until the first record).  Refused
        (:class:`RecordsError`) when the stored header's fingerprint differs from ``header``'s (the first differing
        field named), or any record is broken or belongs elsewhere."""
        path = folder / HEADER
        if not path.exists():
            if folder.exists() and any(folder.glob("*.json")):
                raise RecordsError(f"{folder}: records without {HEADER}; restore it (git) or move the folder away")
            return cls(folder, header)
        stored = read_record(path, StudyHeader)
        _check_header(path, stored, header)
        out = cls(folder, stored)
        out._load()
        return out

    def _load(self) -> None:
        trials: dict[int, TrialRecord] = {}
        for path in sorted(self.folder.glob("trial-*.json")):
            rec = self._checked(path, read_record(path, TrialRecord))
            if rec.index in trials:
                raise RecordsError(f"{path}: a second record of trial {rec.index}")
            trials[rec.index] = rec
        missing = sorted(set(range(len(trials))) - set(trials))
        if missing:
            raise RecordsError(f"{self.folder}: trial {missing[0]}'s record is missing (trials run 0..n-1)")
        self.trials = [trials[i] for i in range(len(trials))]
        for path in sorted(self.folder.glob("reproduction-*.json")):
            rep = self._checked(path, read_record(path, ReproductionRecord))
            if rep.index in self.reproductions:
                raise RecordsError(f"{path}: a second record of reproduction {rep.index}")
            self.reproductions[rep.index] = rep

    def _checked(self, path: Path, rec):
        expected_name = f"trial-{rec.index:03d}.json" if rec.kind == "trial" else f"reproduction-{rec.index}.json"
        if path.name != expected_name:
            raise RecordsError(f"{path}: holds {rec.kind} {rec.index}, whose file is {expected_name}")
        if rec.study != self.header.study:
            raise RecordsError(f"{path}: study {rec.study!r}, not {self.header.study!r}")
        if rec.fingerprint != self.header.fingerprint["hash"]:
            raise RecordsError(
                f"{path}: fingerprint {rec.fingerprint}, not the study's {self.header.fingerprint['hash']} ({HEADER})"
            )
        return rec

    def has_trial(self, trial_id: str) -> bool:
        return any(t.trial_id == trial_id for t in self.trials)

    def add_trial(self, rec: TrialRecord) -> None:
        """Write trial ``rec`` (its index must be the next one); a trial already recorded is left as it is."""
        if self.has_trial(rec.trial_id):
            return
        if rec.index != len(self.trials):
            raise RecordsError(f"{self.folder}: trial {rec.index} recorded after {len(self.trials)} trials")
        self._ensure_header()
        _write_new(self.folder / f"trial-{rec.index:03d}.json", _dump(rec))
        self.trials.append(rec)

    def add_reproduction(self, rec: ReproductionRecord) -> None:
        """Write reproduction ``rec``; one already recorded is left as it is."""
        if rec.index in self.reproductions:
            return
        self._ensure_header()
        _write_new(self.folder / f"reproduction-{rec.index}.json", _dump(rec))
        self.reproductions[rec.index] = rec

    def _ensure_header(self) -> None:
        path = self.folder / HEADER
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                _write_new(path, _dump(self.header))
            except RecordsError:  # written meanwhile (another study thread cannot: one folder per study)
                _check_header(path, read_record(path, StudyHeader), self.header)


def _check_header(path: Path, stored: StudyHeader, expected: StudyHeader) -> None:
    if stored.study != expected.study:
        raise RecordsError(f"{path}: study {stored.study!r}, not {expected.study!r}")
    diff = first_difference(Fingerprint.from_json(expected.fingerprint), Fingerprint.from_json(stored.fingerprint))
    if diff is not None:
        name, found, want = diff
        raise RecordsError(
            f"{path}: recorded under another protocol: {name} is {shown_value(found)} in the records and "
            f"{shown_value(want)} in this sweep; use another records folder, or the records' setting"
        )
    for name in ("trials", "reproductions", "searched"):
        a, b = getattr(stored, name), getattr(expected, name)
        if a != b:
            raise RecordsError(
                f"{path}: recorded with {name} {shown_value(a)}, this sweep has {shown_value(b)}; use another records "
                "folder, or the records' setting"
            )


def _write_new(path: Path, text: str) -> None:
    """``text`` as ``path``, complete or not at all, and never over an existing file (os.link fails if it exists)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep a shared records folder from the colleagues it is for
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise RecordsError(f"{path}: exists already; it is kept as it is") from None
    finally:
        os.unlink(tmp)


def header_of(doc: dict[str, Any]) -> StudyHeader:
    """A header from its fields (``schema`` and ``kind`` added)."""
    return StudyHeader.model_validate({"schema": SCHEMA, "kind": "study", **doc})
