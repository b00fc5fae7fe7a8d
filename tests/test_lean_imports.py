"""A warm fold process for the tiny model stays lean, and a search trial's driver loads no torch.

`torchvision.transforms` imports `torchvision.ops`, which pulls in `torch._dynamo` (~150 MB of resident memory,
`bench/README_overhead.md`).  The tiny trunk and the protocol transforms need neither, so a fresh interpreter doing
what a warm fold worker does must not load torchvision at all, and must not load `torch._dynamo` while it imports the
fold code and builds the tiny model, the loss and both transforms (and applies them).  Training may load
`torch._dynamo`: torch's own optimisers import it on construction (`Optimizer.add_param_group` is wrapped in
`torch._disable_dynamo`, torch 2.x), which no code of ours can avoid.

A search trial's driver (a Tune actor process of its own) submits warm fold tasks and reduces their
``outcome.json``: it needs Ray, MLflow and numpy, not torch, whose import (a CUDA build) costs seconds of CPU in every
such process — nor scipy.stats, for a fold summary's SEM.  Ray Train folds and a reproduction's test evaluation load
torch where they run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FOLD_LIKE = r"""
import json, sys
import torch
import pipelines.execution.folds.fold, pipelines.execution.folds.warm  # what a warm fold task imports
from dml_core.data import ImageDataset, eval_transform, synthetic, train_transform
from dml_core.losses import build_loss
from dml_core.models import build_model
from dml_core.training.loop import TrainConfig, embed, train_fold

def heavy(prefixes):
    return sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in prefixes))

torch.set_num_threads(1)
table = synthetic(num_classes=8, per_class=8, image_size=20, seed=0)
model = build_model(trunk="tiny", embedding_dim=16)
loss = build_loss("contrastive", num_classes=4, embedding_dim=16)
train = ImageDataset(table.subset([0, 1, 2, 3]), train_transform(16))
val = ImageDataset(table.subset([4, 5, 6, 7]), eval_transform(16))
x, _ = train[0]
model(torch.stack([x, val[0][0]]))
built = heavy(["torchvision", "torch._dynamo"])
res = train_fold(model, loss, train, val, TrainConfig(classes_per_batch=4, m=4, iters_per_epoch=2, max_epochs=1,
                                                       eval_every=1, seed=0))
embed(model, val, batch_size=16)
trained = heavy(["torchvision"])
print(json.dumps({"status": res.status, "built": built[:8], "n_built": len(built), "trained": trained[:8],
                  "n_trained": len(trained)}))
"""


def test_tiny_fold_process_loads_no_torchvision_and_no_dynamo_before_training():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _FOLD_LIKE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "ok"
    assert out["n_built"] == 0, f"imports + tiny model + transforms loaded {out['n_built']} modules: {out['built']}"
    assert out["n_trained"] == 0, f"training the tiny model loaded {out['n_trained']} modules: {out['trained']}"


_SEARCH_TRIAL_DRIVER = r"""
import json, sys, tempfile
from pathlib import Path
import ray.train, ray.tune
import pipelines.execution.folds.trial as trial, pipelines.execution.folds.warm  # the trainable and the warm executor
from pipelines.names import HEADLINE_METRICS, OUTCOME_FILE
from pipelines.tracking.evaluations import evaluation_metrics

# what the driver does with a fold's result directory: read it, reduce the folds, log its history and cost
d = Path(tempfile.mkdtemp())
best = {k: 0.5 for k in HEADLINE_METRICS}
outcome = {"status": "ok", "reason": "", "fold": 0, "best_metrics": best, "time_start": 1.0, "time_end": 3.0,
           "history": [{"iteration": 0, "epoch": 0, "metrics": best, "train_loss": 0.1}]}
(d / OUTCOME_FILE).write_text(json.dumps(outcome))
read, emb, labels = trial._read_outcome(str(d))
summary = trial.reduce_folds([read, read])
metrics = evaluation_metrics(read.history[0])
cost = trial.fold_cost(read, 1.0, 0.0)
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"map_at_r": summary["val.map_at_r.mean"], "epoch": metrics["epoch"], "wall": cost["wall_seconds"],
                  "torch": torch[:5], "n_torch": len(torch), "scipy_stats": "scipy.stats" in sys.modules}))
"""


def test_a_search_trials_driver_imports_and_reduces_folds_without_loading_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _SEARCH_TRIAL_DRIVER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["map_at_r"], out["epoch"], out["wall"]) == (0.5, 0, 2.0)
    assert out["n_torch"] == 0, f"a search trial's driver loaded {out['n_torch']} torch modules: {out['torch']}"
    # nor scipy.stats (~0.5 s of imports): a fold summary's SEM needs numpy only
    assert not out["scipy_stats"], "a search trial's driver loaded scipy.stats"
