"""Concise live progress: one line per trial start / finish / failure, one line per finished study.

Ray Tune's own status table is switched off (``verbose=0``): with four folds × N workers per trial it is mostly
resource bookkeeping.  Per-evaluation lines come from rank 0 of each fold (``pipelines.execution.folds.fold``) through
Ray's log forwarding.  The callback runs in the sweep driver (Tune's controller) and is pickled with the experiment
state, so it must stay small and hold no open handles.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray.tune import Callback

from pipelines.names import OBJECTIVE

__all__ = ["TrialProgress", "format_duration"]


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def _short(params: dict[str, Any]) -> str:
    parts = []
    for k, v in params.items():
        if k.startswith("__"):
            continue
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)


class TrialProgress(Callback):
    """Prints ``[study] trial i/N ...`` lines; ``total`` is the number of trials the Tuner will run."""

    def __init__(self, label: str, total: int, kind: str = "trial", done: Sequence[Mapping[str, Any]] = ()):
        """``done``: the result rows of the study's trials finished before this run (its records), counted and
        bested with the ones this run finishes, so the 8th trial of 20 says 8/20 and the best is the study's."""
        self.label = label
        self.total = total
        self.kind = kind
        self.done = len(done)
        ok = [r[OBJECTIVE] for r in done if r.get("status") == "ok" and isinstance(r.get(OBJECTIVE), float)]
        self.best: float | None = max(ok) if ok else None
        self.t0 = time.time()

    def __setstate__(self, state):  # restored on --resume: the clock restarts
        self.__dict__.update(state)
        self.t0 = time.time()

    def _print(self, msg: str) -> None:
        print(f"[{self.label}] {msg}", file=sys.stdout, flush=True)

    def on_trial_start(self, iteration: int, trials: list, trial, **info):
        rep = trial.config.get("__reproduction__")
        what = f"reproduction {rep} of the best config" if rep is not None else _short(trial.config)
        self._print(f"{self.kind} {trial.trial_id} started ({what})")

    def on_trial_complete(self, iteration: int, trials: list, trial, **info):
        self.done += 1
        r = trial.last_result or {}
        obj = r.get(OBJECTIVE)
        if obj is None:
            return
        if r.get("status") == "ok" and (self.best is None or obj > self.best):
            self.best = obj
        sem = r.get("val_map_at_r_sem")
        sem_s = f" ± {sem:.4f}" if isinstance(sem, float) and sem == sem else ""
        extra = ""
        if "test_concat_map_at_r" in r:
            extra = f"; test MAP@R concat {r['test_concat_map_at_r']:.4f} separated {r['test_separated_map_at_r']:.4f}"
        status = r.get("status", "?")
        why = f" ({r.get('reason')})" if status != "ok" and r.get("reason") else ""
        best = f", best {self.best:.4f}" if self.best is not None else ""
        self._print(
            f"{self.kind} {self.done}/{self.total} {trial.trial_id}: val MAP@R {obj:.4f}{sem_s} [{status}{why}]"
            f"{best}{extra} — {format_duration(time.time() - self.t0)} elapsed"
        )

    def on_trial_error(self, iteration: int, trials: list, trial, **info):
        self.done += 1
        self._print(f"{self.kind} {self.done}/{self.total} {trial.trial_id} FAILED (see its MLflow run's 'reason' tag)")
