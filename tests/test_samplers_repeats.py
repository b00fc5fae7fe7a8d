"""The m-per-class sampler says when a class has fewer than ``m`` images (its batches then repeat images)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dml_core.training.samplers import MPerClassBatchSampler, RepeatedImagesWarning


def test_a_class_smaller_than_m_is_warned_about_once_per_sampler():
    labels = np.array([0] * 6 + [1] * 2 + [2] * 6 + [3] * 6)
    with pytest.warns(RepeatedImagesWarning, match=r"1 of 4 classes have fewer than m = 4 images \(e.g. class 1: 2\)"):
        MPerClassBatchSampler(labels, m=4, classes_per_batch=2, iters_per_epoch=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other DDP ranks stay quiet; so does a sampler whose classes all fit
        MPerClassBatchSampler(labels, m=4, classes_per_batch=2, iters_per_epoch=3, num_replicas=2, rank=1)
        MPerClassBatchSampler(labels, m=2, classes_per_batch=2, iters_per_epoch=3)
