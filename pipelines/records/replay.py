"""Pruning rules replayed offline on recorded searches, as Syne Tune's blackbox repository and LCBench do: which rule
saves how much CPU, and does the search still find the same winner?

Each recorded trial is fed, in the order the search ran it, to a real Ray Tune scheduler (``ASHAScheduler`` or
``MedianStoppingRule``) exactly as a pruned search reports to it (:class:`pipelines.execution.search.pruning.Rungs`): at
evaluation ``e`` the fold mean of each fold's best validation MAP@R so far.  A trial the scheduler stops at ``e``
saves each fold's CPU past that evaluation; the replayed winner is the best trial the scheduler let finish.  The
replay keeps the recorded proposals: a real pruned search's optimiser would also have seen the pruned values and
proposed differently (the usual approximation of offline replay), so a kept winner is evidence, not proof.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, TrialScheduler

if TYPE_CHECKING:
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment import Trial

from pipelines.names import OBJECTIVE
from pipelines.records.model import TrialRecord

__all__ = ["Rule", "StudyReplay", "replay_study", "fold_mean_curve", "default_rules", "WINNER_TOLERANCE"]

#: A replayed winner within this of the recorded winner's validation MAP@R is as good (validation on 30 classes
#: moves by about ±0.03 between evaluations: bench/README_convergence.md).
WINNER_TOLERANCE = 0.03
_EVALUATION = "evaluation"


@dataclass(frozen=True)
class Rule:
    kind: str  # "asha" | "median"
    grace: int  # evaluations before the first decision
    reduction: float = 3.0  # ASHA's reduction factor

    @property
    def name(self) -> str:
        if self.kind == "asha":
            return f"asha grace {self.grace} ×{self.reduction:g}"
        return f"median grace {self.grace}"

    def scheduler(self, max_t: int) -> TrialScheduler:
        if self.kind == "asha":
            return ASHAScheduler(
                time_attr=_EVALUATION,
                metric=OBJECTIVE,
                mode="max",
                max_t=max_t,
                grace_period=self.grace,
                reduction_factor=self.reduction,
            )
        return MedianStoppingRule(
            time_attr=_EVALUATION, metric=OBJECTIVE, mode="max", grace_period=self.grace, hard_stop=True
        )


def default_rules() -> list[Rule]:
    asha = [Rule("asha", g, r) for g in (1, 2, 4) for r in (2.0, 3.0, 4.0)]
    return asha + [Rule("median", g) for g in (2, 4, 8)]


class _Trial:
    """What a scheduler needs of a trial outside a running Tune: an id (and a hashable identity)."""

    def __init__(self, trial_id: str) -> None:
        self.trial_id = trial_id

    def __repr__(self) -> str:
        return self.trial_id


class _Controller:
    """The tune controller a scheduler may ask for live trials: none wait (trials replay one at a time)."""

    def get_live_trials(self) -> list:
        return []


def _spacing(trial: TrialRecord) -> int:
    """Iterations between evaluations (the curves' step)."""
    for f in trial.folds:
        if len(f.curve) > 1:
            return f.curve[1][0] - f.curve[0][0]
    return 0


def fold_mean_curve(trial: TrialRecord, max_t: int) -> list[float]:
    """The value a pruned search reports at evaluations 1..max_t: the fold mean of each fold's best val MAP@R up to
    there (a fold that stopped earlier keeps its best)."""
    out = []
    for e in range(1, max_t + 1):
        best = [max(v for _, v in f.curve[: e + 1]) if f.curve else 0.0 for f in trial.folds]
        out.append(sum(best) / len(best) if best else 0.0)
    return out


@dataclass
class StudyReplay:
    rule: Rule
    study: str
    cpu_seconds: float  # what the recorded (unpruned) search used
    cpu_saved: float  # what the rule would have saved
    pruned: int  # trials the rule stopped
    winner: str  # the recorded winner's trial id
    replayed_winner: str
    gap: float  # recorded winner's val MAP@R − the replayed winner's (0: the same trial)

    @property
    def kept(self) -> bool:
        return self.gap <= WINNER_TOLERANCE

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule.name,
            "study": self.study,
            "cpu_seconds": self.cpu_seconds,
            "cpu_saved": self.cpu_saved,
            "pruned": self.pruned,
            "winner": self.winner,
            "replayed_winner": self.replayed_winner,
            "gap": self.gap,
            "kept": self.kept,
        }


def replay_study(study: str, trials: list[TrialRecord], rule: Rule, max_t: int) -> StudyReplay:
    """``rule`` replayed on a study's recorded search (``trials`` in order, ``max_t`` evaluations per fold)."""
    # the stand-ins as the schedulers' signatures name them: they use no more of a trial or controller than these have
    scheduler, controller = rule.scheduler(max_t), cast("TuneController", _Controller())
    finished: list[TrialRecord] = []
    saved = 0.0
    pruned = 0
    for rec in trials:
        trial = cast("Trial", _Trial(rec.trial_id))
        scheduler.on_trial_add(controller, trial)
        curve = fold_mean_curve(rec, max_t)
        stopped_at = None
        for e in range(1, max_t):  # the last evaluation is the trial's final result
            action = scheduler.on_trial_result(controller, trial, {_EVALUATION: e, OBJECTIVE: curve[e - 1]})
            if action == TrialScheduler.STOP:
                stopped_at = e
                break
        if stopped_at is None:
            scheduler.on_trial_complete(controller, trial, {_EVALUATION: max_t, OBJECTIVE: rec.objective})
            finished.append(rec)
            continue
        pruned += 1
        at = stopped_at * _spacing(rec)
        saved += sum(f.cpu_seconds * max(0, f.iterations - at) / f.iterations for f in rec.folds if f.iterations)
        scheduler.on_trial_remove(controller, trial)
    ok = [t for t in trials if t.status == "ok"]
    best = max(ok, key=lambda t: t.objective) if ok else None
    kept = [t for t in finished if t.status == "ok"]
    replayed = max(kept, key=lambda t: t.objective) if kept else None
    return StudyReplay(
        rule=rule,
        study=study,
        cpu_seconds=sum(t.cpu_seconds for t in trials),
        cpu_saved=saved,
        pruned=pruned,
        winner=best.trial_id if best else "",
        replayed_winner=replayed.trial_id if replayed else "",
        gap=(best.objective - replayed.objective) if best and replayed else (0.0 if not best else float("inf")),
    )


def max_t_of(header) -> int:
    """Evaluations per fold of a recorded study (its fingerprint's ``protocol.max_epochs // protocol.eval_every``)."""
    fields = header.fingerprint["fields"]
    return int(fields["protocol.max_epochs"]) // int(fields["protocol.eval_every"])


def replay_all(studies: list[tuple[str, list[TrialRecord], int]], rules: list[Rule]) -> dict[Rule, list[StudyReplay]]:
    """Every rule on every ``(study, trials, max_t)``."""
    return {rule: [replay_study(s, trials, rule, max_t) for s, trials, max_t in studies] for rule in rules}


def choose_rule(results: dict[Rule, list[StudyReplay]]) -> Rule | None:
    """The rule that saves the most CPU among those that kept every study's winner; None if none did."""
    safe = [r for r, reps in results.items() if reps and all(x.kept for x in reps)]
    if not safe:
        return None
    return max(safe, key=lambda r: sum(x.cpu_saved for x in results[r]))
