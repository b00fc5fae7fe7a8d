"""A warm fold process for the tiny model stays lean.

`torchvision.transforms` imports `torchvision.ops`, which pulls in `torch._dynamo` (~150 MB of resident memory,
`bench/README_overhead.md`).  The tiny trunk and the protocol transforms need neither, so a fresh interpreter doing
what a warm fold worker does must not load torchvision at all, and must not load `torch._dynamo` while it imports the
fold code and builds the tiny model, the loss and both transforms (and applies them).  Training may load
`torch._dynamo`: torch's own optimisers import it on construction (`Optimizer.add_param_group` is wrapped in
`torch._disable_dynamo`, torch 2.x), which no code of ours can avoid.
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
import pipelines.execution.fold, pipelines.execution.warm_folds  # what a warm fold task imports
from dml_core.data import ImageDataset, eval_transform, synthetic, train_transform
from dml_core.losses import build_loss
from dml_core.models import build_model
from dml_core.train import TrainConfig, embed, train_fold

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
