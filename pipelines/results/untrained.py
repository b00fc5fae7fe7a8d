"""The floor a study is measured against: the test-class metrics of its network with its initial weights.

The reality check's released code reports the untrained trunk (+ embedder) on the test set beside the trained models
(docs/protocol.md §Test evaluation).  A sweep computes it once per (dataset, network) — one embedding pass of the test
classes on the driver — logs it on every study run of that dataset and network as ``untrained.<metric>``
(:data:`UNTRAINED_PREFIX`) and prints it as a reference row; ``dmlrc report`` shows it the same way.  A study whose
results are close to this row learned little.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["UNTRAINED_PREFIX", "untrained_key", "untrained_test_metrics", "untrained_metrics_of"]

#: Prefix of the untrained network's test metrics on a study run (``untrained.map_at_r``, ...).
UNTRAINED_PREFIX = "untrained."


def untrained_key(plan) -> tuple[str, str]:
    """What the untrained score depends on: the dataset and the network's settings (trunk, pooling, embedding, ...);
    studies of one dataset and one network share one computation."""
    return plan.dataset.spec.name, json.dumps(plan.model_kwargs, sort_keys=True, default=str)


def untrained_test_metrics(plan, seed: int, *, batch_size: int = 256, device: str = "cpu") -> dict[str, float]:
    """Test-class retrieval metrics of the study's network with its initial weights (seeded), compared to self,
    embedded on ``device``.

    The caller's global RNG state is left as it was (the network is built under ``torch.random.fork_rng``)."""
    # torch and the model zoo only where the metrics are computed: `dmlrc report` imports this module for
    # untrained_metrics_of and must not load torch
    import torch

    # torch, see above
    from dml_core.data import ImageDataset, eval_transform
    from dml_core.metrics import retrieval_metrics
    from dml_core.models import build_model
    from dml_core.train import embed

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(**plan.model_kwargs).to(device)
    data = plan.dataset
    test = ImageDataset(
        data.table.subset(list(data.manifest.test_classes)), eval_transform(data.spec.image_size, model.preprocessing)
    )
    emb, labels = embed(model, test, batch_size=batch_size)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the sweep's driver keeps running beside the folds: give their GPU memory back
    return {k: float(v) for k, v in retrieval_metrics(emb, labels).items()}


def untrained_metrics_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The ``untrained.*`` metrics of a run's metric dict, without the prefix."""
    return {k[len(UNTRAINED_PREFIX) :]: v for k, v in metrics.items() if k.startswith(UNTRAINED_PREFIX)}
