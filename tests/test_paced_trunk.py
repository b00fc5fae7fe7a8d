"""tests/paced_trunk.py, the fault tests' trunk: its training steps wait only while the pace file exists."""

from __future__ import annotations

import time

import torch

from tests.paced_trunk import PACE_FILE_ENV, PACE_S, pace_file, paced_tiny


def _step_seconds(trunk) -> float:
    t0 = time.perf_counter()
    trunk(torch.zeros(2, 3, 16, 16))
    return time.perf_counter() - t0


def test_training_steps_wait_while_the_pace_file_exists_and_evaluation_never(tmp_path, monkeypatch):
    trunk = paced_tiny()
    assert trunk(torch.zeros(2, 3, 16, 16)).shape[1] == trunk.feature_dim
    path = pace_file(tmp_path)
    monkeypatch.setenv(PACE_FILE_ENV, str(path))
    assert _step_seconds(trunk.train()) >= PACE_S
    assert _step_seconds(trunk.eval()) < PACE_S
    path.unlink()  # the test's fault is done: full speed
    assert _step_seconds(trunk.train()) < PACE_S
    monkeypatch.delenv(PACE_FILE_ENV)  # no pace file named: always paced
    assert _step_seconds(trunk.train()) >= PACE_S
