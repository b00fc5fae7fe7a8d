"""Class splits of the Metric Learning Reality Check (MLRC; Musgrave et al., ECCV 2020).

Everything here works on **class ids**, never on sample indices: a split says which classes go where, and
the data layer keeps the rows of those classes (``ImageTable.subset(classes)``).

1. :func:`trainval_test_split` (docs/protocol.md §Class split): the sorted unique class ids are cut in two halves
   without shuffling; the first ``int(0.5·N)`` are trainval, the rest are test (CUB 0–99 | 100–199,
   Cars 1–98 | 99–196, SOP 0–11316 | 11317–22633).
2. :func:`class_disjoint_folds` (docs/protocol.md §Folds): the sorted trainval classes are cut into class-disjoint
   cross-validation folds, in one of two layouts.

   * ``"mlrc"`` — powerful-benchmarker's ``MLRCSplitManager``, the layout that produced the paper's numbers.
     With ``T`` trainval classes and ``n`` folds, every fold has ``len_val = T // n`` val classes and
     ``len_train = T − len_val`` train classes.  Fold ``p`` starts at index ``int(p/n · T)``; train takes the
     next ``len_train`` classes (wrapping around the end of the list) and val the ``len_val`` after those.
     Hence train ∪ val = all trainval classes in every fold, but some classes may never be in any val fold:

     =========  ===========  ==========================================  ========================
     dataset    train / val  val indices (within trainval), folds 0..3   never in val
     =========  ===========  ==========================================  ========================
     CUB        75 / 25      75–99, 0–24, 25–49, 50–74                   —
     Cars       74 / 24      74–97, 0–23, 25–48, 49–72                   24, 73
     SOP        8488 / 2829  8488–11316, 0–2828, 2829–5657, 5658–8486    8487
     =========  ===========  ==========================================  ========================

     How the lengths follow from the original code: it computes them from the *total* class count ``N``
     (val = ``int(N·0.5/n)``, test = ``int(N·0.5)``, train = the remainder ``N − test − val``).  Since
     ``T = int(0.5·N)``, ``int(N·0.5/n) = T // n`` for every ``N`` (an odd ``N`` never crosses a multiple of
     ``2n``), and for even ``N`` the remainder is ``T − T // n``.  For odd ``N`` the original remainder is one
     larger, so its val block wraps onto the fold's first train class and its own class-disjointness
     assertion fails; we use ``T − T // n`` throughout, identical for CUB/Cars/SOP (all even ``N``).  We
     also use integer arithmetic for ``len_val`` (exact), and the original float formula for the fold
     start (exact for ``n = 4``).

   * ``"kfold"`` — powerful-benchmarker's default ``ClassDisjointSplitManager``: ``sklearn.KFold(n,
     shuffle=False)`` over the sorted trainval classes, i.e. fold ``i`` validates on the ``i``-th contiguous
     block; the first ``T mod n`` blocks are one class larger (Cars 25/25/24/24, SOP 2830/2829/2829/2829).
     Implemented here without sklearn (the tests check it against sklearn).

3. :class:`FoldManifest` records exactly which classes every fold used, as canonical JSON with a sha256
   ``content_hash``; the sweep stores it with every study so runs can be paired and re-evaluated.
4. :func:`validate_folds` checks folds against the sample labels before anything expensive starts, and
   reports every problem in one ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LAYOUTS",
    "Fold",
    "FoldManifest",
    "trainval_test_split",
    "class_disjoint_folds",
    "validate_folds",
]

LAYOUTS = ("mlrc", "kfold")
_MANIFEST_FORMAT = "dmlrc-fold-manifest/1"


# --------------------------------------------------------------------------------------------------------------
# input checking


def _as_int_array(values, name: str) -> np.ndarray:
    """1-D int64 array from a list / numpy array / torch tensor; a clear ValueError naming ``name`` otherwise."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # torch.Tensor, without importing torch here
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == object):
        raise ValueError(f"{name} must hold integer class ids, got dtype {arr.dtype}")
    if arr.dtype == object:
        bad = [v for v in arr.tolist() if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
        if bad:
            raise ValueError(f"{name} must hold integer class ids; not integers: {bad[:10]}")
    return arr.astype(np.int64)


def _sorted_unique_classes(classes, name: str) -> np.ndarray:
    arr = _as_int_array(classes, name)
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name} has duplicate class ids: {uniq[counts > 1].tolist()}")
    return uniq


# --------------------------------------------------------------------------------------------------------------
# trainval / test


def trainval_test_split(labels) -> tuple[np.ndarray, np.ndarray]:
    """Split the sorted unique class ids of ``labels`` into (trainval, test) halves (docs/protocol.md §Class split).

    ``labels`` are the per-sample labels (any integer ids; they need not be 0..N-1).  The first
    ``int(0.5·N)`` sorted class ids are trainval, the remaining ``N − int(0.5·N)`` are test; no shuffling.
    Returns two sorted int64 arrays of class ids.
    """
    classes = np.unique(_as_int_array(labels, "labels"))
    if classes.size < 2:
        raise ValueError(f"labels must contain at least 2 classes to split trainval/test, got {classes.tolist()}")
    n_trainval = int(0.5 * classes.size)
    return classes[:n_trainval].copy(), classes[n_trainval:].copy()


# --------------------------------------------------------------------------------------------------------------
# folds


@dataclass(frozen=True)
class Fold:
    """One cross-validation fold: the class ids it trains on and the class ids it validates on (sorted)."""

    index: int
    train_classes: tuple[int, ...]
    val_classes: tuple[int, ...]

    def __post_init__(self):
        # Normalise to plain sorted Python ints so folds compare, hash and serialise the same whatever built them.
        if isinstance(self.index, bool) or not isinstance(self.index, (int, np.integer)):
            raise ValueError(f"fold index must be an integer, got {self.index!r}")
        object.__setattr__(self, "index", int(self.index))
        for name in ("train_classes", "val_classes"):
            arr = _sorted_unique_classes(list(getattr(self, name)), f"fold {self.index} {name}")
            object.__setattr__(self, name, tuple(arr.tolist()))

    def to_dict(self) -> dict:
        return {"index": self.index, "train_classes": list(self.train_classes), "val_classes": list(self.val_classes)}


def _mlrc_blocks(n_classes: int, n_folds: int) -> list[tuple[list[int], list[int]]]:
    """(train, val) positions in the sorted trainval list for MLRCSplitManager (docs/protocol.md §Folds)."""
    len_val = n_classes // n_folds
    len_train = n_classes - len_val
    blocks = []
    for p in range(n_folds):
        start = int((float(p) / n_folds) * n_classes)  # the original's float formula
        train = [(start + i) % n_classes for i in range(len_train)]
        val = [(start + len_train + i) % n_classes for i in range(len_val)]
        blocks.append((train, val))
    return blocks


def _kfold_blocks(n_classes: int, n_folds: int) -> list[tuple[list[int], list[int]]]:
    """(train, val) positions for sklearn ``KFold(n_folds, shuffle=False)``: contiguous val blocks,
    the first ``n_classes mod n_folds`` of them one larger."""
    sizes = [n_classes // n_folds + (1 if i < n_classes % n_folds else 0) for i in range(n_folds)]
    blocks, start = [], 0
    for size in sizes:
        val = list(range(start, start + size))
        train = [i for i in range(n_classes) if not start <= i < start + size]
        blocks.append((train, val))
        start += size
    return blocks


def class_disjoint_folds(
    trainval_classes,
    n_folds: int = 4,
    layout: str = "mlrc",
    labels=None,
    *,
    min_val_samples: int = 2,
    min_train_classes: int = 0,
) -> list[Fold]:
    """Cut the trainval classes into ``n_folds`` class-disjoint folds (docs/protocol.md §Folds; layouts in the
    module doc).

    ``trainval_classes`` are class ids (e.g. Cars 1..98); folds index into their sorted order and return
    class ids.  If ``labels`` (per-sample labels of the dataset) is given, the folds are also checked with
    :func:`validate_folds` (``min_val_samples``, ``min_train_classes``) so a bad dataset fails here.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(n_folds, bool) or not isinstance(n_folds, (int, np.integer)) or n_folds < 2:
        raise ValueError(f"n_folds must be an integer >= 2, got {n_folds!r}")
    n_folds = int(n_folds)
    classes = _sorted_unique_classes(trainval_classes, "trainval_classes")
    if classes.size < n_folds:
        raise ValueError(
            f"too few trainval classes for {n_folds} class-disjoint folds: {classes.size} classes "
            f"{classes.tolist()}; every fold needs at least one val class"
        )
    blocks = (_mlrc_blocks if layout == "mlrc" else _kfold_blocks)(classes.size, n_folds)
    folds = [
        Fold(index=i, train_classes=tuple(classes[train].tolist()), val_classes=tuple(classes[val].tolist()))
        for i, (train, val) in enumerate(blocks)
    ]
    validate_folds(folds, labels, min_val_samples=min_val_samples, min_train_classes=min_train_classes)
    return folds


def validate_folds(
    folds: Sequence[Fold],
    labels=None,
    *,
    min_val_samples: int = 2,
    min_train_classes: int = 0,
) -> None:
    """Check folds before anything expensive starts; raise ONE ``ValueError`` listing every problem.

    Always checked: fold indices are 0..n−1 in order, every fold has val classes, train and val of a fold
    share no class, and no class is validated on in two folds (the reference asserts both, docs/protocol.md §Folds).
    With ``labels`` (per-sample labels): every val class has ≥ ``min_val_samples`` samples (a lone sample
    has no positive to retrieve, so MAP@R/R-Precision are undefined for it, docs/protocol.md §Metrics), every
    train class has ≥ 1 sample, and every fold has ≥ ``min_train_classes`` train classes with samples (e.g. the
    sampler's ``classes_per_batch``).  Without labels, the train-class count uses the class ids alone.

    A fold with a single val class passes with a warning: retrieval metrics inside one class are
    trivially 1.0, so such a fold cannot rank losses.
    """
    problems, notes = _fold_problems(folds, labels, min_val_samples, min_train_classes)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    if problems:
        raise ValueError("invalid class-disjoint folds:\n  " + "\n  ".join(problems))


def _fold_problems(folds, labels, min_val_samples: int, min_train_classes: int) -> tuple[list[str], list[str]]:
    """(problems, notes) of :func:`validate_folds`: problems are errors, notes are warnings."""
    problems: list[str] = []
    notes: list[str] = []
    counts: dict[int, int] | None = None
    if labels is not None:
        uniq, cnt = np.unique(_as_int_array(labels, "labels"), return_counts=True)
        counts = dict(zip(uniq.tolist(), cnt.tolist()))

    indices = [f.index for f in folds]
    if indices != list(range(len(folds))):
        problems.append(f"fold indices must be 0..{len(folds) - 1} in order, got {indices}")

    seen_val: dict[int, int] = {}
    for f in folds:
        where = f"fold {f.index}"
        if not f.val_classes:
            problems.append(f"{where}: no val classes")
        elif len(f.val_classes) == 1:
            notes.append(f"{where} has a single val class {f.val_classes[0]}: retrieval metrics are trivially 1.0")
        overlap = sorted(set(f.train_classes) & set(f.val_classes))
        if overlap:
            problems.append(f"{where}: classes in both train and val: {overlap}")
        again = sorted(c for c in f.val_classes if c in seen_val)
        if again:
            problems.append(
                f"{where}: val classes already validated on in another fold: "
                + ", ".join(f"{c} (fold {seen_val[c]})" for c in again)
            )
        for c in f.val_classes:
            seen_val.setdefault(c, f.index)

        if counts is not None:
            small = [(c, counts.get(c, 0)) for c in f.val_classes if counts.get(c, 0) < min_val_samples]
            if small:
                problems.append(
                    f"{where}: val classes with fewer than {min_val_samples} samples: "
                    + ", ".join(f"{c} ({n} sample{'s' if n != 1 else ''})" for c, n in small)
                )
            empty = [c for c in f.train_classes if counts.get(c, 0) == 0]
            if empty:
                problems.append(f"{where}: train classes with no samples: {empty}")
            n_train = len(f.train_classes) - len(empty)
        else:
            n_train = len(f.train_classes)
        if n_train < min_train_classes:
            problems.append(
                f"{where}: {n_train} train classes with samples, fewer than the {min_train_classes} a batch needs"
            )
    return problems, notes


# --------------------------------------------------------------------------------------------------------------
# manifest


def _canonical_json(payload: dict) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class FoldManifest:
    """Exactly which classes a sweep used: trainval/test classes and every fold's train/val classes.

    ``to_json()`` writes canonical JSON (sorted keys, compact) including ``content_hash`` = sha256 of the
    canonical JSON of everything else; ``from_json()`` checks that hash, so two studies whose manifests
    have the same hash ran on identical class splits.
    """

    trainval_classes: tuple[int, ...]
    test_classes: tuple[int, ...]
    folds: tuple[Fold, ...]
    layout: str

    def __post_init__(self):
        trainval = _sorted_unique_classes(list(self.trainval_classes), "trainval_classes")
        test = _sorted_unique_classes(list(self.test_classes), "test_classes")
        object.__setattr__(self, "trainval_classes", tuple(trainval.tolist()))
        object.__setattr__(self, "test_classes", tuple(test.tolist()))
        object.__setattr__(self, "folds", tuple(self.folds))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        problems = []
        both = sorted(set(self.trainval_classes) & set(self.test_classes))
        if both:
            problems.append(f"classes in both trainval and test: {both}")
        if not self.folds:
            problems.append("no folds")
        known = set(self.trainval_classes)
        for f in self.folds:
            if not isinstance(f, Fold):
                raise ValueError(f"folds must be Fold objects, got {type(f).__name__}")
            outside = sorted(c for c in f.train_classes + f.val_classes if c not in known)
            if outside:
                problems.append(f"fold {f.index}: classes not in trainval_classes: {outside}")
        problems += _fold_problems(self.folds, None, 0, 0)[0]
        if problems:
            raise ValueError("invalid fold manifest:\n  " + "\n  ".join(problems))

    @classmethod
    def from_labels(
        cls, labels, n_folds: int = 4, layout: str = "mlrc", *, min_val_samples: int = 2, min_train_classes: int = 0
    ) -> FoldManifest:
        """The protocol in one call: trainval/test halves, then folds, checked against ``labels``."""
        trainval, test = trainval_test_split(labels)
        folds = class_disjoint_folds(
            trainval, n_folds, layout, labels, min_val_samples=min_val_samples, min_train_classes=min_train_classes
        )
        return cls(tuple(trainval.tolist()), tuple(test.tolist()), tuple(folds), layout)

    @property
    def n_folds(self) -> int:
        return len(self.folds)

    def _payload(self) -> dict:
        return {
            "format": _MANIFEST_FORMAT,
            "layout": self.layout,
            "trainval_classes": list(self.trainval_classes),
            "test_classes": list(self.test_classes),
            "folds": [f.to_dict() for f in self.folds],
        }

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of the manifest's content."""
        return hashlib.sha256(_canonical_json(self._payload()).encode("ascii")).hexdigest()

    def to_json(self) -> str:
        return _canonical_json({**self._payload(), "content_hash": self.content_hash})

    @classmethod
    def from_json(cls, s: str | bytes) -> FoldManifest:
        try:
            data = json.loads(s)
        except (TypeError, ValueError) as e:
            raise ValueError(f"fold manifest is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"fold manifest must be a JSON object, got {type(data).__name__}")
        if data.get("format") != _MANIFEST_FORMAT:
            raise ValueError(f"fold manifest field 'format' must be {_MANIFEST_FORMAT!r}, got {data.get('format')!r}")
        missing = [k for k in ("layout", "trainval_classes", "test_classes", "folds") if k not in data]
        if missing:
            raise ValueError(f"fold manifest is missing field(s): {missing}")
        folds = []
        for i, f in enumerate(_as_list(data["folds"], "folds")):
            if not isinstance(f, dict) or any(k not in f for k in ("index", "train_classes", "val_classes")):
                raise ValueError(f"fold manifest folds[{i}] must have 'index', 'train_classes' and 'val_classes'")
            folds.append(
                Fold(
                    f["index"],
                    tuple(_as_list(f["train_classes"], f"folds[{i}].train_classes")),
                    tuple(_as_list(f["val_classes"], f"folds[{i}].val_classes")),
                )
            )
        manifest = cls(
            tuple(_as_list(data["trainval_classes"], "trainval_classes")),
            tuple(_as_list(data["test_classes"], "test_classes")),
            tuple(folds),
            data["layout"],
        )
        stored = data.get("content_hash")
        if stored is not None and stored != manifest.content_hash:
            raise ValueError(
                f"fold manifest field 'content_hash' is {stored!r} but its content hashes to "
                f"{manifest.content_hash!r}: the manifest was edited or corrupted"
            )
        return manifest


def _as_list(value, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"fold manifest field {name!r} must be a JSON list, got {type(value).__name__}")
    return value
