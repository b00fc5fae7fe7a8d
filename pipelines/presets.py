"""Built-in sweep presets: what ``dmlrc demo`` runs with no arguments from a fresh clone.

``DEMO`` mirrors ``configs/demo.yaml`` (a test checks they parse to the same sweep), so the demo needs no file
and no network.  It is a *smoke* run of the whole protocol, not a benchmark: synthetic data, a tiny CNN, three
losses (the reality-check baseline ``contrastive`` and two seed-paper methods, ``proxynca_pp`` (ProxyNCA++) and
``mpa`` (Multi-Proxy-Anchor)), 2 BO trials each (one random start-up trial, one GP suggestion), 4 folds of 2 gloo
DDP workers, 2 reproductions.  Each trial costs about a minute on a busy 2-core machine, almost all of it process
start-up (4 folds × (Train controller + helpers + 2 workers)); see bench/README_overhead.md.
"""

from __future__ import annotations

import copy
import time
from typing import Any

__all__ = ["DEMO", "demo_config"]

DEMO: dict[str, Any] = {
    "name": "demo",
    "seed": 0,
    "datasets": [
        {"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 12, "image_size": 16},
    ],
    "losses": [
        {"name": "contrastive"},
        {"name": "proxynca_pp"},
        {"name": "mpa"},
    ],
    "model": {"trunk": "tiny", "embedding_dim": 32, "freeze_bn": False},
    "protocol": {
        "folds": 4,
        "fold_layout": "mlrc",
        "trials": 2,
        "startup_trials": 1,
        "sampler": "gp",
        "reproductions": 2,
        "iters_per_epoch": 8,
        "eval_every": 1,
        "patience": 1,
        "max_epochs": 3,
        # One batch for every loss, as the reality check (32 = 8 classes × 4); the losses' own paper batches
        # (e.g. MPA's 45 classes) would not fit 12 train classes per fold.
        "train": {"classes_per_batch": 8, "m": 4, "trunk_lr": 1.0e-3, "embedder_lr": 1.0e-3,
                  "eval_batch_size": 64},
    },
    "resources": {"workers_per_fold": 2, "use_gpu": False, "cpus_per_worker": 1, "max_concurrent_trials": 1},
    "tracking": {"uri": None, "experiment": None},
    "storage": "runs",
}


def demo_config(name: str | None = None, storage: str | None = None) -> dict[str, Any]:
    """The demo preset with a fresh, timestamped sweep name (so ``make demo`` can be run again and again)."""
    cfg = copy.deepcopy(DEMO)
    cfg["name"] = name or time.strftime("demo-%Y%m%d-%H%M%S")
    if storage:
        cfg["storage"] = storage
    return cfg
