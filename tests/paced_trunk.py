"""The trunk of the sweeps that kill something mid-fold (``model.trunk: "tests.paced_trunk:paced_tiny"``).

Those tests need folds that stay in training for a known while until their fault is injected (a fold caught after
its 2nd or 3rd evaluation and still training), not folds that compute: a real ``tiny`` trunk spends ~60 ms of CPU
per training step on a batch of 32 16-px images, and the fault sweeps trained ~20,000 steps between them, most of
the CPU the test suite used.  This trunk is ``tiny``'s architecture at a quarter of its widths (about 1/16 of its
multiply-adds) whose training forward pass also waits :data:`PACE_S` while the test's pace file exists
(:data:`PACE_FILE_ENV`; always, if that variable is unset): before the fault a step takes about as long as a real
one on a loaded machine, without using the CPU; once the test has injected its fault it deletes the file and the
rest of the sweep (restarts, ``--resume``, reproductions) runs at full speed.  Evaluation (``eval()`` mode) never
waits.

It is a trunk plug-in by import path (docs/trunks.md): the sweeps' processes import it from this checkout
(``PYTHONPATH``), the cluster nodes of ``tests/cluster.py`` included.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from dml_core.trunks.builtin import TinyCNN

#: The trunk's name in a sweep config.
PACED_TRUNK = "tests.paced_trunk:paced_tiny"
#: Environment variable (of every fold process: the sweep's environment or its ``runtime_env.env_vars``) naming
#: the pace file.
PACE_FILE_ENV = "DMLRC_TEST_PACE_FILE"
#: Seconds each training forward pass waits (without using the CPU) while the pace file exists.
PACE_S = 0.06
WIDTHS = (8, 16, 32, 64)


class PacedTinyCNN(TinyCNN):
    def __init__(self) -> None:
        super().__init__(widths=WIDTHS)
        self.feature_dim = WIDTHS[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            pace_file = os.environ.get(PACE_FILE_ENV)
            if pace_file is None or os.path.exists(pace_file):
                time.sleep(PACE_S)
        return super().forward(x)


def paced_tiny() -> torch.nn.Module:
    return PacedTinyCNN()


def pace_file(folder: Path) -> Path:
    """A new pace file in ``folder`` (steps wait while it exists); the test deletes it once its fault is done."""
    path = Path(folder) / "paced-steps"
    path.write_text("training steps wait while this file exists (tests/paced_trunk.py)\n")
    return path
