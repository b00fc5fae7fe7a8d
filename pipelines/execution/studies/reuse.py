"""Studies a sweep does not run again: finished studies of its MLflow experiment and the studies of the results bundles
it names (``compare_with``), each proven comparable by its protocol fingerprint before anything starts.

A user adds a loss to a finished sweep's config and runs it again: only the new study runs; the finished ones (of
this sweep or of any other sweep logged to the same experiment) are kept and enter the final table, the report and
the paired tests.  ``--rerun LOSS`` runs a finished study again (the old run is kept, tagged superseded).  A bundle's
studies join the same way.  Every finished or bundled study on one of the config's datasets must have the config's
fingerprint (:mod:`pipelines.results.fingerprint`); the first field that differs is refused in one line.  Everything
here only reads: no experiment, sqlite DB or folder is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from pipelines.config.errors import ConfigError
from pipelines.config.schema import SweepConfig
from pipelines.execution.preflight.study_plans import StudyPlan
from pipelines.execution.studies.fingerprints import study_fingerprints
from pipelines.names import study_key
from pipelines.results.bundle import Bundle, comparable_studies, read_bundles
from pipelines.results.fingerprint import (
    Fingerprint,
    fingerprint_of_tags,
    first_difference,
    shown_value,
)
from pipelines.results.report_studies import Study
from pipelines.tracking.runs import search_all

__all__ = ["Reuse", "find_reuse"]


@dataclass
class Reuse:
    """What a sweep takes from elsewhere instead of running it."""

    #: study key → the config's fingerprint for that study
    fingerprints: dict[str, Fingerprint]
    #: study key → the newest finished study run of the experiment on one of the config's datasets
    finished: dict[str, Any] = field(default_factory=dict)
    #: study key → a bundle's study on one of the config's datasets
    from_bundles: dict[str, Study] = field(default_factory=dict)
    bundles: list[Bundle] = field(default_factory=list)
    #: study key → the finished run that --rerun replaces
    rerun: dict[str, Any] = field(default_factory=dict)
    #: study key → this sweep's failed study run (kept as it is, unless --rerun replaces it)
    failed: dict[str, Any] = field(default_factory=dict)
    #: the loss names of --rerun
    rerun_losses: frozenset[str] = frozenset()
    #: this sweep's study runs that did not finish (a sweep with these continues only with --resume)
    unfinished: list[str] = field(default_factory=list)

    def covered(self) -> dict[str, str]:
        """Study key → where its result comes from, for every study the sweep does not run."""
        out = {
            key: f"finished study run {run.info.run_id} (sweep {run.data.tags.get('sweep', '?')})"
            for key, run in self.finished.items()
            if key not in self.rerun
        }
        out.update({key: s.source for key, s in self.from_bundles.items()})
        return out


def _experiment_study_runs(cfg: SweepConfig) -> list:
    """Every active study run of the config's experiment, read without creating the store or the experiment."""
    uri = cfg.tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        return []
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment_name())
    if exp is None or exp.lifecycle_stage != "active":
        return []
    return search_all(client, exp.experiment_id, "tags.stage = 'study'")


def _check(expected: Fingerprint, found: Fingerprint | None, what: str, advice: str) -> None:
    diff = None if found is None else first_difference(expected, found)
    if diff is not None:
        key, old, new = diff
        raise ConfigError(key, f"differs from {what} ({shown_value(old)} vs {shown_value(new)}); {advice}")


def _expected(fps: dict[str, Fingerprint], plans: list[StudyPlan], key: str, dataset: str) -> Fingerprint:
    """The config's fingerprint for study ``key``, or (a loss the config does not list) for any of its studies on
    ``dataset``."""
    return fps.get(key) or next(fps[p.key] for p in plans if p.dataset.spec.name == dataset)


def _finished_runs(cfg: SweepConfig, plans: list[StudyPlan], reuse: Reuse) -> None:
    datasets = {p.dataset.spec.name for p in plans}
    newest: dict[str, Any] = {}
    for run in sorted(_experiment_study_runs(cfg), key=lambda r: r.info.start_time):
        tags = run.data.tags
        key = study_key(tags.get("dataset", "?"), tags.get("loss", "?"))
        done = tags.get("done") == "true" and tags.get("status") == "ok"
        if not done:
            if tags.get("sweep") == cfg.name:  # this sweep's: to --resume, or a failed study that --rerun replaces
                if tags.get("done") == "true":
                    reuse.failed[key] = run
                else:
                    reuse.unfinished.append(key)
            continue
        if tags.get("dataset") in datasets and any(k.startswith("test.") for k in run.data.metrics):
            newest[key] = run
    reuse.finished = newest


def _check_finished(cfg: SweepConfig, plans: list[StudyPlan], reuse: Reuse) -> None:
    for key, run in reuse.finished.items():
        if key in reuse.rerun:
            continue
        tags = run.data.tags
        found = fingerprint_of_tags(tags)
        where = f"MLflow run {run.info.run_id}, sweep {tags.get('sweep', '?')}"
        if found is None:
            if tags.get("sweep") == cfg.name:
                continue  # this sweep's own study from before fingerprints: --resume's stored config covers it
            raise ConfigError(
                "tracking.experiment",
                f"the finished study {key} ({where}) records no protocol fingerprint (it predates them), so it cannot "
                f"be shown comparable; use another experiment, or --rerun {tags.get('loss')}",
            )
        _check(
            _expected(reuse.fingerprints, plans, key, tags.get("dataset", "")),
            found,
            "the finished studies",
            f"study {key} ({where}) ran with the first value: set it back to compare with them, or run this "
            "protocol in another experiment (tracking.experiment)",
        )


def _take_bundles(cfg: SweepConfig, plans: list[StudyPlan], reuse: Reuse) -> None:
    if not cfg.compare_with:
        return
    reuse.bundles = read_bundles(list(cfg.compare_with))
    held = {
        (run.data.tags.get("dataset", "?"), run.data.tags.get("loss", "?")): (
            f"the finished MLflow run {run.info.run_id} (sweep {run.data.tags.get('sweep', '?')})"
        )
        for key, run in reuse.finished.items()
        if key not in reuse.rerun
    }
    for s in comparable_studies(
        reuse.bundles,
        "compare_with",
        {p.dataset.spec.name for p in plans},
        lambda dataset, loss: _expected(reuse.fingerprints, plans, study_key(dataset, loss), dataset),
        held,
    ):
        if s.loss in reuse.rerun_losses:
            raise ConfigError(
                "--rerun", f"{s.loss!r} on {s.dataset!r} comes from {s.source}: a bundle's study is not rerun here"
            )
        reuse.from_bundles[study_key(s.dataset, s.loss)] = s


def find_reuse(cfg: SweepConfig, plans: list[StudyPlan], rerun: set[str] | frozenset[str] = frozenset()) -> Reuse:
    """The studies ``cfg`` takes from its experiment and its bundles, checked; ``rerun``: loss names to run again.
    Raises :class:`ConfigError` naming the first differing fingerprint field, an unknown ``--rerun`` loss or a
    study that two sources hold."""
    names = {p.loss.name for p in plans}
    for loss in sorted(rerun):
        if loss not in names:
            raise ConfigError("--rerun", f"{loss!r} is not a loss of this config (have: {', '.join(sorted(names))})")
    reuse = Reuse(study_fingerprints(cfg, plans), rerun_losses=frozenset(rerun))
    _finished_runs(cfg, plans, reuse)
    done = {**reuse.failed, **reuse.finished}
    reuse.rerun = {p.key: done[p.key] for p in plans if p.loss.name in rerun and p.key in done}
    _check_finished(cfg, plans, reuse)
    _take_bundles(cfg, plans, reuse)
    return reuse
