"""Whether and how a sweep starts: its stored config (what ``--resume`` compares with, and what a run that adds
losses may change), the experiment's unfinished and finished studies of the same sweep, and the folder and MLflow
experiment it opens.  Every check here runs before Ray starts or anything is written."""

from __future__ import annotations

import json
from typing import Any

from pipelines.config.redact import shown
from pipelines.config.schema import ConfigError, SweepConfig
from pipelines.execution.preflight.study_plans import StudyPlan
from pipelines.execution.runtime.interrupts import reopen_interrupted
from pipelines.execution.studies.reuse import Reuse
from pipelines.names import COMPARE_WITH_TAG
from pipelines.tracking.runs import Tracker
from pipelines.tracking.ui import set_experiment_ui

__all__ = [
    "CONFIG_FILE",
    "check_restart",
    "check_resume",
    "check_continuation",
    "open_tracker",
    "store_config_or_reopen",
]

#: The sweep's config as it last ran, in its local folder.
CONFIG_FILE = "sweep_config.json"


def _artifact_location(cfg: SweepConfig) -> str | None:
    """Artifacts next to the sweep's storage (``<storage>/<name>/mlartifacts``, on S3 when it is ``s3://``) for a
    file/sqlite/postgres tracking DB; an HTTP server chooses its own (proxied) store."""
    if cfg.tracking_uri().startswith(("http://", "https://")):
        return None
    if cfg.storage_is_s3:
        return cfg.storage.rstrip("/") + "/" + cfg.name + "/mlartifacts"
    return (cfg.local_dir() / "mlartifacts").as_uri()


#: Config keys that may change between runs of one sweep: a bigger cluster, a moved checkout, a fixed plugin, more
#: bundles to compare with, a records folder (its own fingerprint checks guard it).  ``losses`` may gain entries
#: (new studies); every other key is what is studied.
_MAY_CHANGE = ("resources", "tune_spaces", "runtime_env", "compare_with", "records")


def _config_changes(cfg: SweepConfig) -> list[str] | None:
    """The stored config's keys that ``cfg`` changes (``losses`` only when an entry was changed or removed, not
    when entries were added); None when the sweep has no stored config yet."""
    stored = cfg.local_dir() / CONFIG_FILE
    if not stored.exists():
        return None
    old = json.loads(stored.read_text())
    new = json.loads(json.dumps(cfg.model_dump(mode="json")))
    changed = []
    for key in sorted(set(old) | set(new)):
        if key in _MAY_CHANGE or old.get(key) == new.get(key):
            continue
        if key == "losses" and all(entry in new["losses"] for entry in old.get("losses", [])):
            continue  # losses added: their studies are new, the finished ones are reused
        changed.append(key)
    return changed


def check_restart(cfg: SweepConfig, resume: bool, rerun: set[str] | frozenset[str] = frozenset()) -> None:
    """The same config run again without ``--resume`` is refused at once (it would start over in the old folder);
    a config that adds losses to the sweep, or changes it, goes on to the checks that name what differs."""
    changes = _config_changes(cfg)
    if changes is None or resume or rerun:
        return
    old_losses = json.loads((cfg.local_dir() / CONFIG_FILE).read_text()).get("losses", [])
    if not changes and len(cfg.model_dump(mode="json")["losses"]) == len(old_losses):
        raise ConfigError(
            "name",
            f"a sweep named {cfg.name!r} already exists in {cfg.local_dir()}; pass --resume to continue it, add a "
            "loss to run only its study, --rerun LOSS to run one again, or choose another name",
        )


def _first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any] | None:
    """``(dotted path, old value, new value)`` of the first leaf where ``old`` and ``new`` differ (keys in sorted
    order; two lists of different lengths differ as a whole), or None."""
    if old == new:
        return None
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            found = _first_difference(old.get(k, "absent"), new.get(k, "absent"), f"{path}.{k}" if path else k)
            if found:
                return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
    if isinstance(old, list) and isinstance(new, list):
        return path, f"{len(old)} entries", f"{len(new)} entries"
    return path, old, new


def _changed_field(old: dict[str, Any], new: dict[str, Any], key: str) -> tuple[str, Any, Any]:
    """The exact field of top-level ``key`` that differs (``protocol.max_epochs``), with both values.  ``seed`` is
    named as itself: the datasets' and the protocol's seeds left unset take its value, so they change with it."""
    if key == "losses":  # entries may be added: the first stored entry the config no longer has, as changed or removed
        olds, news = old.get("losses", []), new.get("losses", [])
        i, gone = next((i, e) for i, e in enumerate(olds) if e not in news)
        name = gone.get("name") if isinstance(gone, dict) else None
        j = next((j for j, e in enumerate(news) if isinstance(e, dict) and e.get("name") == name), None)
        if j is None:
            return f"losses[{i}]", name, "removed"
        found = _first_difference(gone, news[j], f"losses[{j}]")
        return found if found else (f"losses[{j}]", gone, news[j])
    found = _first_difference(old.get(key, "absent"), new.get(key, "absent"), key)
    return found if found else (key, old.get(key), new.get(key))


def check_resume(cfg: SweepConfig) -> None:
    """What a sweep studies must not change under its stored Tuners (``Tuner.restore`` cannot change what is
    searched): the exact field that differs is named, with its stored and its new value."""
    changes = _config_changes(cfg)
    if changes:
        stored = cfg.local_dir() / CONFIG_FILE
        old = json.loads(stored.read_text())
        new = json.loads(json.dumps(cfg.model_dump(mode="json")))
        field, was, now = _changed_field(old, new, "seed" if "seed" in changes else changes[0])
        raise ConfigError(
            field,
            f"differs from the sweep being resumed ({shown(was)} there, {shown(now)} now; stored in {stored}); "
            "Tuner.restore cannot change what is searched (losses may only be added)",
        )


def check_continuation(cfg: SweepConfig, resume: bool, plans: list[StudyPlan], reuse: Reuse, shown: str) -> None:
    """Without ``--resume`` a sweep must not pick up another run's unfinished studies of the same name; it may add
    studies to a finished sweep (new losses, ``--rerun``), but not start one whose every study has finished."""
    if resume:
        return
    if reuse.unfinished:
        raise ConfigError(
            "name",
            f"MLflow experiment {cfg.experiment_name()!r} at {shown} already has runs of a sweep named {cfg.name!r} "
            f"that did not finish ({', '.join(sorted(set(reuse.unfinished)))}); pass --resume to continue it, or "
            "choose another name",
        )
    own = [k for k, run in reuse.finished.items() if run.data.tags.get("sweep") == cfg.name]
    todo = [p.key for p in plans if p.key not in reuse.covered()]
    if own and not todo:
        raise ConfigError(
            "name",
            f"every study of sweep {cfg.name!r} has finished (MLflow experiment {cfg.experiment_name()!r} at {shown}); "
            "add a loss to run only its study, --rerun LOSS to run one again, or choose another name",
        )


def open_tracker(cfg: SweepConfig, uri: str) -> Tracker:
    """The sweep's folder and MLflow experiment; the bundles it compares with are listed on the experiment (for
    ``dmlrc report``)."""
    cfg.local_dir().mkdir(parents=True, exist_ok=True)
    tracker = Tracker.open(uri, cfg.experiment_name(), _artifact_location(cfg))
    set_experiment_ui(tracker.client, tracker.experiment_id)  # once, before the studies run concurrently
    if cfg.compare_with:
        exp = tracker.client.get_experiment(tracker.experiment_id)
        listed = json.loads(exp.tags.get(COMPARE_WITH_TAG, "[]"))
        merged = listed + [u for u in cfg.compare_with if u not in listed]
        tracker.client.set_experiment_tag(tracker.experiment_id, COMPARE_WITH_TAG, json.dumps(merged))
    return tracker


def store_config_or_reopen(cfg: SweepConfig, resume: bool, tracker: Tracker, out) -> None:
    """The sweep stores its config (what ``--resume`` compares with; a config that added losses replaces the stored
    one, the only change the checks let through); a resumed one reopens its interrupted runs."""
    local = cfg.local_dir()
    existed = (local / CONFIG_FILE).exists()
    if resume and not existed:
        print(f"--resume: no sweep {cfg.name!r} in {local} yet; starting it", file=out, flush=True)
    (local / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
    if resume and existed:
        reopen_interrupted(tracker, cfg.name)
