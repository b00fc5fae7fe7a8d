"""Class splits: MLRC layout (powerful-benchmarker MLRCSplitManager), sklearn-KFold layout, manifest, validation.

External anchors: the tables of docs/protocol.md §Class split and §Folds, sklearn.model_selection.KFold, and an
independent re-derivation of the MLRC rule from the released code's own arithmetic (lengths from the *total* class
count, wrapped numeric class ranges; docs/protocol.md §Folds).
"""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest

from dml_core.splits import Fold, FoldManifest, class_disjoint_folds, trainval_test_split, validate_folds

# --------------------------------------------------------------------------------------------------------------
# trainval / test (docs/protocol.md §Class split)


@pytest.mark.parametrize(
    "first, n_classes, trainval_last",
    [(0, 200, 99), (1, 196, 98), (0, 22634, 11316)],  # CUB 0-199, Cars 1-196, SOP 0-22633
    ids=["cub", "cars", "sop"],
)
def test_trainval_test_halves_match_the_mlrc_datasets(first, n_classes, trainval_last):
    classes = np.arange(first, first + n_classes)
    labels = np.repeat(classes, 2)[::-1]  # per-sample labels, unsorted, repeated
    trainval, test = trainval_test_split(labels)
    assert trainval.tolist() == list(range(first, trainval_last + 1))
    assert test.tolist() == list(range(trainval_last + 1, first + n_classes))
    assert trainval.dtype == np.int64 and test.dtype == np.int64


def test_trainval_test_odd_class_count_gives_test_the_extra_class():
    trainval, test = trainval_test_split([7, 3, 11, 5, 9, 9])  # 5 classes: int(2.5) = 2 trainval
    assert trainval.tolist() == [3, 5] and test.tolist() == [7, 9, 11]


def test_trainval_test_split_rejects_bad_labels():
    with pytest.raises(ValueError, match="at least 2 classes"):
        trainval_test_split([4, 4, 4])
    with pytest.raises(ValueError, match="integer"):
        trainval_test_split([0.5, 1.5])
    with pytest.raises(ValueError, match="1-D"):
        trainval_test_split(np.zeros((2, 2), dtype=int))


# --------------------------------------------------------------------------------------------------------------
# MLRC layout (docs/protocol.md §Folds)

MLRC_TABLE = {
    # name: (first class id, n trainval classes, val index ranges per fold (inclusive), never-in-val indices)
    "cub": (0, 100, [(75, 99), (0, 24), (25, 49), (50, 74)], []),
    "cars": (1, 98, [(74, 97), (0, 23), (25, 48), (49, 72)], [24, 73]),
    "sop": (0, 11317, [(8488, 11316), (0, 2828), (2829, 5657), (5658, 8486)], [8487]),
}


@pytest.mark.parametrize("name", list(MLRC_TABLE))
def test_mlrc_val_blocks_match_the_spec_table(name):
    first, n, val_ranges, never = MLRC_TABLE[name]
    trainval = np.arange(first, first + n)
    folds = class_disjoint_folds(trainval, 4, "mlrc")
    assert [f.index for f in folds] == [0, 1, 2, 3]
    for f, (lo, hi) in zip(folds, val_ranges):
        assert f.val_classes == tuple(range(first + lo, first + hi + 1))
    in_val = {c for f in folds for c in f.val_classes}
    assert sorted(set(trainval.tolist()) - in_val) == [first + i for i in never]


@pytest.mark.parametrize("name", list(MLRC_TABLE))
def test_mlrc_train_is_trainval_minus_val_in_every_fold(name):
    # The original computes len_train as a remainder from the total class count N; for even N (all three
    # datasets) len_train + len_val = T, so the wrapped train block is exactly the complement of val:
    # no class is in neither (Cars: 74 + 24 = 98) even though some are never validated on.
    first, n, val_ranges, _ = MLRC_TABLE[name]
    trainval = set(range(first, first + n))
    expected_train = {"cub": 75, "cars": 74, "sop": 8488}[name]
    for f in class_disjoint_folds(sorted(trainval), 4, "mlrc"):
        assert len(f.train_classes) == expected_train
        assert set(f.train_classes) == trainval - set(f.val_classes)
        assert list(f.train_classes) == sorted(f.train_classes)


def _mlrc_oracle(all_classes: list[int], n_folds: int) -> list[tuple[list[int], list[int]]]:
    """MLRCSplitManager's arithmetic (docs/protocol.md §Folds): lengths from the ratios of the TOTAL class count
    (val = (1/n)(1-0.5), train = (1-val)(1-0.5), test = 0.5, int-truncated, remainder to train), trainval =
    first int(0.5 N) sorted labels, fold p starts at int(p/n * T), class rules are numeric label ranges
    [label(s), label(e)] that wrap (label >= a or label <= b) when the range passes the end of the list."""
    n_total = len(all_classes)
    val_ratio = (1.0 / n_folds) * 0.5
    train_ratio = (1.0 - val_ratio) * 0.5
    lengths = {"train": int(n_total * train_ratio), "val": int(n_total * val_ratio), "test": int(n_total * 0.5)}
    lengths["train"] += n_total - sum(lengths.values())
    trainval = sorted(all_classes)[: lengths["test"]]
    t = len(trainval)
    out = []
    for p in range(n_folds):
        start = int((p / n_folds) * t)
        rules = {}
        for key in ("train", "val"):
            a, b = trainval[start % t], trainval[(start + lengths[key] - 1) % t]
            rules[key] = (lambda x, a=a, b=b: a <= x <= b) if a < b else (lambda x, a=a, b=b: x >= a or x <= b)
            start += lengths[key]
        out.append(([c for c in trainval if rules["train"](c)], [c for c in trainval if rules["val"](c)]))
    return out


@pytest.mark.parametrize("n_total", [16, 18, 22, 40, 58, 100, 196, 200, 402])
def test_mlrc_agrees_with_the_original_arithmetic_for_even_class_counts(n_total):
    rng = np.random.default_rng(n_total)
    all_classes = sorted(rng.choice(10 * n_total, size=n_total, replace=False).tolist())  # ids not 0..N-1
    trainval, _ = trainval_test_split(all_classes)
    folds = class_disjoint_folds(trainval, 4, "mlrc")
    for f, (train, val) in zip(folds, _mlrc_oracle(all_classes, 4)):
        assert list(f.train_classes) == train and list(f.val_classes) == val


# --------------------------------------------------------------------------------------------------------------
# kfold layout


@pytest.mark.parametrize("n", [8, 9, 98, 100, 1001])
def test_kfold_layout_equals_sklearn_kfold(n):
    from sklearn.model_selection import KFold

    rng = np.random.default_rng(n)
    trainval = rng.choice(5 * n, size=n, replace=False)  # unsorted, not 0..N-1
    sorted_ids = np.sort(trainval)
    folds = class_disjoint_folds(trainval, 4, "kfold")
    for f, (train_idx, val_idx) in zip(folds, KFold(n_splits=4, shuffle=False).split(sorted_ids)):
        assert list(f.train_classes) == sorted_ids[train_idx].tolist()
        assert list(f.val_classes) == sorted_ids[val_idx].tolist()


def test_kfold_block_sizes_for_cars_and_sop():
    cars = class_disjoint_folds(range(1, 99), 4, "kfold")
    assert [len(f.val_classes) for f in cars] == [25, 25, 24, 24]
    assert cars[0].val_classes == tuple(range(1, 26))  # fold 0 validates on the first block (unlike MLRC)
    sop = class_disjoint_folds(range(11317), 4, "kfold")
    assert [len(f.val_classes) for f in sop] == [2830, 2829, 2829, 2829]


def test_other_fold_counts_partition_the_classes():
    for layout in ("mlrc", "kfold"):
        folds = class_disjoint_folds(range(20, 43), 5, layout)  # 23 classes, 5 folds
        assert len(folds) == 5
        for f in folds:
            assert set(f.train_classes) | set(f.val_classes) == set(range(20, 43))
            assert not set(f.train_classes) & set(f.val_classes)


# --------------------------------------------------------------------------------------------------------------
# validation


def test_too_few_classes_for_the_folds_is_one_clear_error():
    with pytest.raises(ValueError, match=r"too few trainval classes.*3 classes \[5, 6, 7\]"):
        class_disjoint_folds([5, 6, 7], 4, "mlrc")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layout": "random"}, "layout"),
        ({"n_folds": 1}, "n_folds"),
        ({"n_folds": 2.0}, "n_folds"),
    ],
)
def test_bad_fold_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        class_disjoint_folds(range(10), **kwargs)


def test_duplicate_trainval_classes_are_listed():
    with pytest.raises(ValueError, match=r"duplicate class ids: \[3, 5\]"):
        class_disjoint_folds([1, 3, 3, 5, 5, 6, 7, 8], 4)


def test_validate_folds_lists_every_offending_val_class_with_its_fold_in_one_error():
    trainval = list(range(8))
    labels = np.repeat(trainval, 3)
    labels = labels[(labels != 1) | (np.arange(labels.size) % 3 == 0)]  # class 1: one sample
    labels = labels[labels != 6]  # class 6: no samples
    folds = class_disjoint_folds(trainval, 4, "kfold")  # val blocks [0,1] [2,3] [4,5] [6,7]
    with pytest.raises(ValueError) as err:
        validate_folds(folds, labels)
    msg = str(err.value)
    assert "fold 0: val classes with fewer than 2 samples: 1 (1 sample)" in msg
    assert "fold 3: val classes with fewer than 2 samples: 6 (0 samples)" in msg
    assert "train classes with no samples: [6]" in msg  # folds 0-2 train on class 6
    # the same check runs when class_disjoint_folds gets labels
    with pytest.raises(ValueError, match="fold 0: val classes with fewer than 2 samples"):
        class_disjoint_folds(trainval, 4, "kfold", labels)
    # min_val_samples=0 switches the val check off; a train class without samples is still an error
    with pytest.raises(ValueError) as err:
        validate_folds(folds, labels, min_val_samples=0)
    assert "val classes" not in str(err.value) and "fold 0: train classes with no samples: [6]" in str(err.value)


def test_validate_folds_min_train_classes_and_min_val_samples():
    trainval = list(range(8))
    labels = np.repeat(trainval, 2)
    folds = class_disjoint_folds(trainval, 4, "kfold")  # 6 train classes per fold
    validate_folds(folds, labels, min_train_classes=6)
    with pytest.raises(ValueError) as err:
        validate_folds(folds, labels, min_train_classes=7)
    assert all(f"fold {i}: 6 train classes with samples, fewer than the 7" in str(err.value) for i in range(4))
    with pytest.raises(ValueError, match="fewer than 3 samples"):
        validate_folds(folds, labels, min_val_samples=3)
    with pytest.raises(ValueError, match="fold 1: 6 train classes"):
        class_disjoint_folds(trainval, 4, "kfold", min_train_classes=7)


def test_validate_folds_catches_overlap_repeats_and_bad_indices():
    folds = [
        Fold(0, (0, 1, 2), (3, 4)),
        Fold(1, (3, 4, 2), (0, 1, 2)),  # 2 is in train and val
        Fold(3, (0, 1), (4, 2)),  # index 3 skips 2; 4 and 2 already validated on
    ]
    with pytest.raises(ValueError) as err:
        validate_folds(folds)
    msg = str(err.value)
    assert "fold indices must be 0..2 in order, got [0, 1, 3]" in msg
    assert "fold 1: classes in both train and val: [2]" in msg
    assert "fold 3: val classes already validated on in another fold: 2 (fold 1), 4 (fold 0)" in msg


def test_a_single_val_class_warns():
    with pytest.warns(UserWarning, match="single val class"):
        class_disjoint_folds(range(5), 4, "mlrc")  # 5 // 4 = 1 val class per fold
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        class_disjoint_folds(range(8), 4, "mlrc")


# --------------------------------------------------------------------------------------------------------------
# manifest


def _cars_manifest(layout="mlrc") -> FoldManifest:
    labels = np.repeat(np.arange(1, 197), 2)
    return FoldManifest.from_labels(labels, 4, layout)


def test_manifest_round_trips_and_records_every_fold():
    m = _cars_manifest()
    assert m.trainval_classes == tuple(range(1, 99)) and m.test_classes == tuple(range(99, 197))
    assert m.n_folds == 4 and m.layout == "mlrc"
    assert m.folds == tuple(class_disjoint_folds(range(1, 99), 4, "mlrc"))
    back = FoldManifest.from_json(m.to_json())
    assert back == m and back.content_hash == m.content_hash
    data = json.loads(m.to_json())
    assert data["folds"][1]["val_classes"] == list(range(1, 25))


def test_content_hash_is_sha256_of_the_canonical_json_without_the_hash():
    m = _cars_manifest()
    data = json.loads(m.to_json())
    stored = data.pop("content_hash")
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert stored == m.content_hash == hashlib.sha256(canonical.encode()).hexdigest()
    # built in another order / from numpy values, the same content hashes the same
    shuffled = FoldManifest(
        tuple(np.arange(98, 0, -1)),
        tuple(reversed(m.test_classes)),
        tuple(Fold(np.int64(f.index), f.train_classes[::-1], f.val_classes[::-1]) for f in m.folds),
        "mlrc",
    )
    assert shuffled.content_hash == m.content_hash
    assert _cars_manifest("kfold").content_hash != m.content_hash


def test_manifest_rejects_edits_and_missing_fields():
    m = _cars_manifest()
    data = json.loads(m.to_json())
    data["folds"][0]["val_classes"][0] = 1000  # not a trainval class
    with pytest.raises(ValueError, match=r"fold 0: classes not in trainval_classes: \[1000\]"):
        FoldManifest.from_json(json.dumps(data))
    data = json.loads(m.to_json())
    data["folds"][0]["train_classes"].remove(1)  # still consistent, but no longer what was hashed
    with pytest.raises(ValueError, match="content_hash"):
        FoldManifest.from_json(json.dumps(data))
    del data["content_hash"]  # a hand-written manifest without a hash is accepted
    assert FoldManifest.from_json(json.dumps(data)).content_hash != m.content_hash
    data = json.loads(m.to_json())
    del data["test_classes"]
    with pytest.raises(ValueError, match=r"missing field\(s\): \['test_classes'\]"):
        FoldManifest.from_json(json.dumps(data))
    data = json.loads(m.to_json())
    data["folds"][2]["index"] = "two"
    with pytest.raises(ValueError, match="fold index must be an integer, got 'two'"):
        FoldManifest.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not valid JSON"):
        FoldManifest.from_json("{nope")


def test_manifest_rejects_classes_in_both_trainval_and_test():
    folds = tuple(class_disjoint_folds(range(8), 4, "kfold"))
    with pytest.raises(ValueError, match=r"classes in both trainval and test: \[6, 7\]"):
        FoldManifest(tuple(range(8)), (6, 7, 8, 9), folds, "kfold")
