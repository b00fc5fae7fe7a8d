"""MLflow layer: the run tree of ``docs/architecture.md`` ("MLflow tree") through :class:`MlflowClient` only.

Why the client and never the fluent API: the fluent API keeps the active run per process/thread, and a sweep writes
from many processes at once (the sweep driver, Tune trial drivers, every fold's worker — rank 0 of a DDP fold).  Every
call here names its run id; every process builds its client from the same *absolute* tracking URI (mlflow #7206,
ray #18387).

Runs are found again by tags, never by name, so that ``dmlrc sweep --resume`` reuses them instead of duplicating:
``sweep`` + ``study`` + ``stage`` (+ ``trial_id`` / ``fold`` / ``reproduction``).  Nesting is the
``mlflow.parentRunId`` tag (what the UI draws as a tree).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, Run, RunTag, ViewType
from mlflow.tracking import MlflowClient

__all__ = ["Tracker", "PARENT", "git_commit", "search_all"]

PARENT = "mlflow.parentRunId"
_MAX_BATCH = 900  # MLflow's log_batch limit is 1000 metrics


def git_commit() -> str:
    """The commit of the checkout this package runs from (``unknown`` outside git), ``+dirty`` if modified."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _quote(v: str) -> str:
    return "'" + str(v).replace("'", "\\'") + "'"


def search_all(
    client: MlflowClient, exp_id: str, filter_string: str, run_view_type: int = ViewType.ACTIVE_ONLY
) -> list[Run]:
    """Every run of ``exp_id`` matching ``filter_string`` (all pages); active ones unless ``run_view_type`` (a
    ``mlflow.entities.ViewType``) says otherwise."""
    runs: list[Run] = []
    token: str | None = None
    while True:
        page = client.search_runs(
            [exp_id], filter_string=filter_string, run_view_type=run_view_type, max_results=1000, page_token=token
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


class Tracker:
    """One MLflow experiment of a sweep, addressed through explicit run ids.

    Cheap to build; picklable by URI (build a new one in each process with :meth:`from_uri`).
    """

    def __init__(self, uri: str, experiment_id: str):
        self.uri = uri
        self.experiment_id = experiment_id
        self.client = MlflowClient(tracking_uri=uri)

    # ------------------------------------------------------------------ experiment
    @classmethod
    def open(cls, uri: str, experiment: str, artifact_location: str | None = None) -> "Tracker":
        """Get or create the experiment ``experiment`` (``artifact_location`` only applies when creating it)."""
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            exp_id = client.create_experiment(experiment, artifact_location=artifact_location)
        elif exp.lifecycle_stage != "active":
            client.restore_experiment(exp.experiment_id)
            exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        return cls(uri, exp_id)

    @classmethod
    def from_uri(cls, uri: str, experiment_id: str) -> "Tracker":
        return cls(uri, experiment_id)

    # ------------------------------------------------------------------ runs
    def find(self, tags: dict[str, Any]) -> list:
        """Active runs whose tags equal ``tags`` (oldest first)."""
        flt = " and ".join(f"tags.`{k}` = {_quote(v)}" for k, v in tags.items())
        runs = search_all(self.client, self.experiment_id, flt)
        return sorted(runs, key=lambda r: r.info.start_time)

    def get_or_create(
        self,
        tags: dict[str, Any],
        *,
        parent: str | None = None,
        run_name: str | None = None,
        reuse_unfinished: bool = True,
    ) -> tuple[str, bool]:
        """``(run_id, created)`` for the run identified by ``tags``.

        With ``reuse_unfinished=False`` a run left RUNNING by a killed process is ended as KILLED and deleted (soft
        delete: hidden from the UI and from searches) and a fresh one created, so that its partial history is not
        mixed with the new attempt -- and no replaced attempt stays RUNNING, even among the deleted runs.
        """
        ident = {k: str(v) for k, v in tags.items()}
        if parent:
            ident[PARENT] = parent
        found = self.find(ident)
        keep = None
        for run in found:
            finished = run.info.status == "FINISHED"
            if keep is None and (finished or reuse_unfinished):
                keep = run
            else:
                self.retire(run)  # a duplicate, or an unfinished attempt we do not reuse
        if keep is not None:
            return keep.info.run_id, False
        run = self.client.create_run(self.experiment_id, tags=ident, run_name=run_name)
        return run.info.run_id, True

    def retire(self, run, reason: str | None = None) -> None:
        """End a run that another one replaces (KILLED if it was RUNNING, with ``reason`` as its tag), then hide it
        (soft delete: out of the UI and of searches, still in the store)."""
        if reason:
            self.set_tags(run.info.run_id, {"status": "replaced", "reason": reason[:4000]})
        if run.info.status == "RUNNING":
            self._retry(self.client.set_terminated, run.info.run_id, "KILLED")
        self.client.delete_run(run.info.run_id)

    def status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    def run(self, run_id: str):
        return self.client.get_run(run_id)

    def children(self, parent: str, **tags: Any) -> list:
        return self.find({PARENT: parent, **tags})

    # ------------------------------------------------------------------ logging
    def log_metrics(self, run_id: str, metrics: Mapping[str, float | None], step: int = 0) -> None:
        """Finite values only (MLflow stores NaN, but a NaN CI bound is better left absent than plotted); None (not
        measured) left out too."""
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, int(step))
            for k, v in metrics.items()
            if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))
        ]
        for i in range(0, len(items), _MAX_BATCH):
            self._retry(self.client.log_batch, run_id, metrics=items[i : i + _MAX_BATCH])

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Params are write-once in MLflow; re-logging on resume skips keys already present with the same value."""
        have = self.client.get_run(run_id).data.params
        items = [Param(k, _param_str(v)) for k, v in params.items() if k not in have]
        if items:
            self._retry(self.client.log_batch, run_id, params=items)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        items = [RunTag(k, str(v)[:5000]) for k, v in tags.items()]
        if items:
            self._retry(self.client.log_batch, run_id, tags=items)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._retry(self.client.set_terminated, run_id, status)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._retry(self.client.log_text, run_id, text, artifact_file)

    def log_json(self, run_id: str, obj: Any, artifact_file: str) -> None:
        self.log_text(run_id, json.dumps(obj, indent=2, sort_keys=True, default=_json_default), artifact_file)

    def log_file(self, run_id: str, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._retry(self.client.log_artifact, run_id, str(path), artifact_path)

    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        folder, name = os.path.split(artifact_file)
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / name
            p.write_bytes(data)
            self.log_file(run_id, p, folder or None)

    def artifact_names(self, run_id: str, path: str | None = None) -> list[str]:
        return [a.path for a in self.client.list_artifacts(run_id, path)]

    @staticmethod
    def _retry(fn, *args, attempts: int = 5, **kwargs):
        # sqlite under many concurrent writers can answer "database is locked"; a short back-off is enough.
        for i in range(attempts):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # only lock errors are retried, everything else re-raised
                if "locked" not in str(e).lower() or i == attempts - 1:
                    raise
                time.sleep(0.2 * (2**i))


def _param_str(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)[:6000]


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
