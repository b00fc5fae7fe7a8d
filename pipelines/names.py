"""Names shared across the orchestration layer: the headline metrics and evaluation modes, the keys of a trial's
Tune config and result, the files a fold leaves, the registered-model alias and how a study is named.

One definition each: the sweep, the MLflow tree, the report, the visuals and re-evaluation read them from here.
"""

from __future__ import annotations

__all__ = [
    "HEADLINE_METRICS",
    "METRIC_LABELS",
    "MODES",
    "REPRODUCTION",
    "PARAMS",
    "OBJECTIVE",
    "OUTCOME_FILE",
    "TEST_EMBEDDINGS",
    "TEST_LABELS",
    "MODEL_FILE",
    "ALIAS",
    "study_key",
    "study_dirname",
    "tuner_name",
    "reproduction_seed",
]

#: The reality check's three headline metrics (docs/protocol.md §Test evaluation), in the order tables show them.
HEADLINE_METRICS = ("precision_at_1", "r_precision", "map_at_r")
#: Their short column labels.
METRIC_LABELS = {"precision_at_1": "P@1", "r_precision": "RP", "map_at_r": "MAP@R"}
#: The two ways the reality check evaluates a reproduction's 4 fold models: their L2-normalised embeddings
#: concatenated, and the mean of each fold model's own metrics.
MODES = ("concat", "separated")

#: Tune config keys of a reproduction trial (a search trial's config is the sampled hyperparameters themselves).
REPRODUCTION = "__reproduction__"
PARAMS = "__params__"
#: The metric Tune and the searcher optimise (mode "max"): the fold mean of the best validation MAP@R.
OBJECTIVE = "val_map_at_r_mean"

#: What a finished fold leaves in its result directory (``outcome.json`` last: it marks a complete result).
OUTCOME_FILE = "outcome.json"
#: The fold run's tag holding when its fold function last began (s since the epoch): set at each start, so that a fold
#: cancelled before its end (a pruned trial's) can be costed; ``time.start`` stays one metric logged with the result.
FOLD_STARTED_TAG = "started_at"
TEST_EMBEDDINGS = "test_embeddings.npy"
TEST_LABELS = "test_labels.npy"
MODEL_FILE = "model.pt"

#: The alias of a study's latest registered model version.
ALIAS = "reality-check"

#: The ``stage`` tag of a study run that ``--rerun`` replaced: kept in the store and the UI, out of every table.
SUPERSEDED_STAGE = "study-superseded"
#: The experiment tag listing the results bundles its sweeps compared with (JSON list of URIs), read by the report.
COMPARE_WITH_TAG = "dmlrc.compare_with"


def study_key(dataset: str, loss: str) -> str:
    """``<dataset>/<loss>``: the MLflow ``study`` tag and (with ':' made safe) the study's storage folder."""
    return f"{dataset}/{loss}"


def study_dirname(key: str) -> str:
    """A study key as a folder name (``/`` and ``:`` replaced)."""
    return key.replace("/", "__").replace(":", "-")


def tuner_name(sweep: str, storage: str, kind: str) -> str:
    """The Tune experiment name of a study's Tuner ``kind`` ("search" or "reproductions"), kept in the study's folder
    ``storage``: unique to the sweep and the study.  Tune stages an experiment's state (trials, searcher) on the driver
    in ``<Ray session>/artifacts/<start second>/<name>`` and copies that whole folder to the experiment's storage, and
    a restored experiment stages under its first start's second again.  Two Tuners of one name started in the same
    second — a sweep's studies start together — would share that folder: each study's storage would receive the
    other's trials and searcher state, and ``--resume`` would restore one study's search with another's (or stop on
    Optuna's ``KeyError`` for a trial its searcher never saw)."""
    return f"{kind}.{sweep}.{storage.rstrip('/').rsplit('/', 1)[-1]}"


def reproduction_seed(base_seed: int, i: int) -> int:
    """Seed of reproduction ``i``: the same for every loss, so ``dmlrc report`` can pair runs across losses."""
    return base_seed + 1000 * (i + 1)
