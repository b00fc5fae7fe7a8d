"""DataLoader workers of the library leave out the traceback of a consumer that went away
(``dml_core/loader_workers.py``): a worker's ``multiprocessing.resource_sharer`` thread, whose connection the
consumer reset in the middle of taking a batch's shared memory (a fold that Ray cancels stops wherever its
interrupt lands), printed a 20-line ``ConnectionResetError`` traceback into the sweep's output.  Every other
exception still reaches ``sys.excepthook``'s output, and both of the library's loaders (training, embedding) install
it in their workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

from dml_core.evaluation.embedding import embed_gathered
from dml_core.training.loop import train_fold
from tests.test_train import PairLoss, config, make_data, make_model

ROOT = Path(__file__).resolve().parents[1]

_CONSUMER_GONE = textwrap.dedent(
    """
    import os
    import socket
    import sys
    import time
    from multiprocessing import resource_sharer

    from dml_core.loader_workers import init_loader_worker

    if sys.argv[1] == "installed":
        init_loader_worker(0)
    r, w = os.pipe()
    shared = resource_sharer.DupFd(r)  # as a worker sharing a batch's memory: starts the sharer's serving thread
    consumer = socket.socket(socket.AF_UNIX)
    consumer.connect(resource_sharer._resource_sharer._address)
    time.sleep(0.5)  # the sharer has sent its challenge, which the consumer never reads
    consumer.close()  # the consumer goes away mid-transfer: the sharer's connection is reset
    time.sleep(1.0)
    sys.excepthook(ValueError, ValueError("another error"), None)  # everything else is still printed
    print("done", flush=True)
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ.get("PYTHONPATH", ""))}
    return subprocess.run(
        [sys.executable, "-c", _CONSUMER_GONE, mode], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_consumer_gone_mid_transfer_prints_nothing_in_the_worker():
    bare = _run("bare")  # what a worker printed before: the failure is real, and loud
    assert bare.returncode == 0 and "done" in bare.stdout, bare.stdout + bare.stderr
    assert "resource_sharer.py" in bare.stderr and ("ConnectionResetError" in bare.stderr or "EOFError" in bare.stderr)

    out = _run("installed")
    assert out.returncode == 0 and "done" in out.stdout, out.stdout + out.stderr
    assert "resource_sharer" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "ValueError: another error" in out.stderr, out.stderr


class _HookSeen(torch.utils.data.Dataset):
    """``base``'s rows (or, without one, 8 blank images), loaded only in a worker that runs the library's excepthook."""

    def __init__(self, base=None):
        self.base = base
        if base is not None:
            self.labels = base.labels

    def __len__(self) -> int:
        return len(self.base) if self.base is not None else 8

    def __getitem__(self, i):
        if not getattr(sys.excepthook, "_dml_core_consumer_gone", False):
            raise RuntimeError("this DataLoader worker did not run init_loader_worker")
        return self.base[i] if self.base is not None else torch.zeros(3, 4, 4)


def test_the_embedding_loaders_workers_install_it():
    emb = embed_gathered(nn.Flatten(), _HookSeen(), batch_size=4, device=torch.device("cpu"), num_workers=1)
    assert emb.shape == (8, 48)


def test_the_training_loaders_workers_install_it():
    train, val = make_data()
    res = train_fold(make_model(), PairLoss(), _HookSeen(train), val, config(num_workers=1, max_epochs=1))
    assert res.status == "ok" and res.iterations == 2
