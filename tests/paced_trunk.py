"""The trunk of the sweeps that kill something mid-fold (``model.trunk: "tests.paced_trunk:paced_tiny"``).

Those tests need folds that stay in training for a known while (a fold caught after its 2nd or 3rd evaluation and
still training), not folds that compute: a real ``tiny`` trunk spends ~60 ms of CPU per training step on a
batch of 32 16-px images, and the fault sweeps train ~20,000 steps between them, most of the CPU the test suite
used.  This trunk is ``tiny``'s architecture at a quarter of its widths (about 1/16 of its multiply-adds) whose
training forward pass also waits :data:`PACE_S`: a step takes about as long as before, on a loaded machine too,
while the CPU is left to the other tests.  Evaluation (``eval()`` mode) does not wait.

It is a trunk plug-in by import path (docs/trunks.md): the sweeps' processes import it from this checkout
(``PYTHONPATH``), the cluster nodes of ``tests/cluster.py`` included.
"""

from __future__ import annotations

import time

import torch

from dml_core.trunks.builtin import TinyCNN

#: The trunk's name in a sweep config.
PACED_TRUNK = "tests.paced_trunk:paced_tiny"
#: Seconds each training forward pass waits (without using the CPU).
PACE_S = 0.06
WIDTHS = (8, 16, 32, 64)


class PacedTinyCNN(TinyCNN):
    def __init__(self) -> None:
        super().__init__(widths=WIDTHS)
        self.feature_dim = WIDTHS[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(PACE_S)
        return super().forward(x)


def paced_tiny() -> torch.nn.Module:
    return PacedTinyCNN()
