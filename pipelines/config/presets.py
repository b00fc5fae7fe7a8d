"""Built-in sweep presets: what ``dmlrc demo`` runs with no arguments from a fresh clone.

The demo preset is defined once, in ``pipelines/config/demo.yaml`` (package data, commented line by line), so the demo
needs no file of the user's and no network.  It is a *smoke* run of the whole protocol, not a benchmark: synthetic
data, a tiny CNN, three losses (the reality-check baseline ``contrastive`` and two seed-paper methods,
``proxynca_pp`` (ProxyNCA++) and ``mpa`` (Multi-Proxy-Anchor)), a few BO trials, 4 warm single-worker folds per
trial and 3 reproductions, so that the intervals mean something.

:func:`untrained_test_metrics` is the reference the demo prints next to its results: the same network, freshly
initialised, on the same unseen test classes — trained models must be clearly above it.
"""

from __future__ import annotations

import copy
import time
from importlib import resources
from typing import Any

import yaml

__all__ = ["DEMO", "DEMO_FILE", "demo_config", "untrained_test_metrics"]

DEMO_FILE = "demo.yaml"
#: The preset as written in ``pipelines/config/demo.yaml`` (sweep name ``demo``).
DEMO: dict[str, Any] = yaml.safe_load(resources.files("pipelines.config").joinpath(DEMO_FILE).read_text(encoding="utf-8"))


def demo_config(name: str | None = None, storage: str | None = None) -> dict[str, Any]:
    """The demo preset with a fresh, timestamped sweep name (so ``make demo`` can be run again and again)."""
    cfg = copy.deepcopy(DEMO)
    cfg["name"] = name or time.strftime("demo-%Y%m%d-%H%M%S")
    if storage:
        cfg["storage"] = storage
    return cfg


def untrained_test_metrics(plan, seed: int) -> dict[str, float]:
    """Test-class retrieval metrics of the study's network with its initial weights (seeded), compared to self —
    the floor the trained models are measured against."""
    import torch

    from dml_core.data import ImageDataset, eval_transform
    from dml_core.metrics import retrieval_metrics
    from dml_core.models import build_model
    from dml_core.train import embed

    torch.manual_seed(seed)
    model = build_model(**plan.model_kwargs)
    data = plan.dataset
    test = ImageDataset(data.table.subset(list(data.manifest.test_classes)), eval_transform(data.spec.image_size))
    emb, labels = embed(model, test, batch_size=256)
    return retrieval_metrics(emb, labels)
