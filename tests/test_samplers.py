"""MPerClassBatchSampler: batch composition, seeding, DDP slicing, coverage, errors."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dml_core.training.samplers import MPerClassBatchSampler


def _labels(sizes) -> np.ndarray:
    """Class c has sizes[c] rows; rows shuffled so indices are not sorted by class."""
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return np.random.default_rng(123).permutation(labels)


def _batches(sampler, epoch=None):
    if epoch is not None:
        sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


def test_batch_is_classes_per_batch_times_m_distinct_classes():
    labels = _labels([3, 5, 7, 9, 11, 4, 6, 8, 10, 12])  # 10 classes, 4 per batch: deck wraps mid-batch
    s = MPerClassBatchSampler(labels, m=3, classes_per_batch=4, iters_per_epoch=50, seed=7)
    assert len(s) == 50 and s.batch_size == s.global_batch_size == 12
    batches = _batches(s)
    assert len(batches) == 50
    for b in batches:
        assert len(b) == 12
        blocks = labels[b].reshape(4, 3)  # class-major: 4 blocks of m rows of one class
        assert (blocks == blocks[:, :1]).all(), blocks
        assert len(set(blocks[:, 0])) == 4, "classes repeat inside a batch"
        for idx in np.asarray(b).reshape(4, 3):
            assert len(set(idx)) == 3, "samples repeat although the class has >= m rows"


def test_classes_with_fewer_than_m_rows_are_drawn_with_replacement():
    labels = _labels([1, 2, 6, 6])
    s = MPerClassBatchSampler(labels, m=4, classes_per_batch=4, iters_per_epoch=5, seed=0)
    for b in _batches(s):
        blocks = np.asarray(b).reshape(4, 4)
        for idx in blocks:
            cls = labels[idx[0]]
            assert (labels[idx] == cls).all()
            n = int((labels == cls).sum())
            assert len(set(idx)) == min(n, 4)  # one-row class: the same row 4 times; two-row class: both rows


def test_same_seed_same_batches_other_seed_or_epoch_differs():
    labels = _labels([6] * 20)

    def mk(seed):
        return MPerClassBatchSampler(labels, m=2, classes_per_batch=5, iters_per_epoch=10, seed=seed)

    a, b, c = mk(3), mk(3), mk(4)
    assert _batches(a) == _batches(b)
    assert _batches(a) == _batches(a), "re-iterating one epoch must repeat it"
    assert _batches(a) != _batches(c)
    e1 = _batches(a, epoch=1)
    assert e1 != _batches(a, epoch=0)
    assert _batches(b, epoch=1) == e1
    assert _batches(a, epoch=0) == _batches(b, epoch=0)


def test_global_rng_state_is_neither_used_nor_changed():
    labels = _labels([5] * 12)
    s = MPerClassBatchSampler(labels, m=2, classes_per_batch=4, iters_per_epoch=8, seed=1)
    np.random.seed(0)
    torch.manual_seed(0)
    first = _batches(s)
    after_np, after_torch = np.random.random(), torch.rand(1)
    np.random.seed(0)
    torch.manual_seed(0)
    assert np.random.random() == after_np and torch.equal(torch.rand(1), after_torch)
    np.random.seed(999)
    torch.manual_seed(999)
    assert _batches(s) == first


@pytest.mark.parametrize("world,m,cpb", [(2, 4, 8), (4, 4, 8), (8, 4, 8), (3, 3, 5), (2, 1, 10)])
def test_rank_slices_concatenate_to_the_single_process_batch(world, m, cpb):
    labels = _labels([1, 3, 4, 7, 9] * 4)
    single = MPerClassBatchSampler(labels, m=m, classes_per_batch=cpb, iters_per_epoch=12, seed=5)
    ranks = [
        MPerClassBatchSampler(
            labels, m=m, classes_per_batch=cpb, iters_per_epoch=12, seed=5, num_replicas=world, rank=r
        )
        for r in range(world)
    ]
    for epoch in (0, 3):
        ref = _batches(single, epoch)
        per_rank = [_batches(s, epoch) for s in ranks]
        for i, batch in enumerate(ref):
            slices = [per_rank[r][i] for r in range(world)]
            assert all(len(sl) == len(batch) // world for sl in slices)
            assert list(itertools.chain(*slices)) == batch, f"epoch {epoch} batch {i}"


def test_every_class_is_visited_uniformly_over_an_epoch():
    labels = _labels(list(range(2, 39)))  # 37 classes, 6 per batch: deck boundaries fall mid-batch
    s = MPerClassBatchSampler(labels, m=2, classes_per_batch=6, iters_per_epoch=100, seed=11)
    for epoch in (0, 1):
        visits = Counter(int(labels[b[0]]) for batch in _batches(s, epoch) for b in np.asarray(batch).reshape(6, 2))
        assert set(visits) == set(range(37))
        assert max(visits.values()) - min(visits.values()) <= 1, visits


def test_samples_within_a_class_are_uniform_subsets():
    # One class of 5 rows, m=2: each of the C(5,2)=10 unordered pairs is equally likely.
    labels = np.array([0] * 5 + [1] * 5)
    s = MPerClassBatchSampler(labels, m=2, classes_per_batch=2, iters_per_epoch=2000, seed=2)
    pairs = Counter(tuple(sorted(b[:2])) if labels[b[0]] == 0 else tuple(sorted(b[2:])) for b in s)
    assert len(pairs) == 10
    assert chisquare(list(pairs.values())).pvalue > 1e-3, pairs
    # and the position within the pair is not biased either
    first = Counter(b[0] for b in s if labels[b[0]] == 0)
    assert chisquare([first[i] for i in range(5)]).pvalue > 1e-3, first


def test_works_as_a_dataloader_batch_sampler():
    labels = _labels([4] * 6)
    ds = torch.utils.data.TensorDataset(torch.arange(len(labels)), torch.as_tensor(labels))
    s = MPerClassBatchSampler(labels, m=2, classes_per_batch=3, iters_per_epoch=4, seed=0, num_replicas=2, rank=1)
    got = [(x.tolist(), y.tolist()) for x, y in torch.utils.data.DataLoader(ds, batch_sampler=s)]
    assert [x for x, _ in got] == _batches(s)
    assert all(len(x) == 3 and y == labels[x].tolist() for x, y in got)


def test_per_batch_cost_does_not_grow_with_dataset_size():
    # 1M rows: building the index is O(N log N) once; each batch must be O(batch).
    labels = np.random.default_rng(0).integers(0, 50_000, size=1_000_000)
    s = MPerClassBatchSampler(labels, m=4, classes_per_batch=8, iters_per_epoch=500, seed=0)
    t = time.perf_counter()
    n = sum(1 for _ in s)
    elapsed = time.perf_counter() - t
    assert n == 500
    assert elapsed < 3.0, f"500 batches took {elapsed:.2f}s: per-batch work is scaling with the dataset"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(m=3, classes_per_batch=5, num_replicas=2), r"3 × 5|5 × 3|= 15 is not divisible by num_replicas = 2"),
        (dict(m=2, classes_per_batch=7), r"4 classes, fewer than classes_per_batch = 7"),
        (dict(m=2, classes_per_batch=2, num_replicas=2, rank=2), r"rank must be in \[0, num_replicas=2\)"),
        (dict(m=0, classes_per_batch=2), r"m must be a positive integer"),
        (dict(m=2, classes_per_batch=2, seed=-1), r"seed must be a non-negative integer"),
        (dict(m=2, classes_per_batch=2, iters_per_epoch=0), r"iters_per_epoch must be a positive integer"),
    ],
)
def test_bad_arguments_raise_naming_the_numbers(kwargs, match):
    labels = _labels([3, 3, 3, 3])
    kwargs = {"iters_per_epoch": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        MPerClassBatchSampler(labels, **kwargs)


@pytest.mark.parametrize(
    "labels,match",
    [(np.zeros((4, 2), dtype=int), "1-D"), (np.array([0.0, 1.0]), "integer"), (np.array([], dtype=int), "non-empty")],
)
def test_bad_labels_raise(labels, match):
    with pytest.raises(ValueError, match=match):
        MPerClassBatchSampler(labels, m=1, classes_per_batch=1, iters_per_epoch=1)


def test_set_epoch_rejects_negative():
    s = MPerClassBatchSampler(_labels([2, 2]), m=1, classes_per_batch=2, iters_per_epoch=1)
    with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
        s.set_epoch(-1)
