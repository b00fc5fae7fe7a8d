"""The floor a study is measured against: the test-class metrics of its network with its initial weights.

The reality check's released code reports the untrained trunk (+ embedder) on the test set beside the trained models
(docs/protocol.md §Test evaluation). A sweep computes it once per (dataset, network) — one embedding pass of the test
classes on the driver (:mod:`pipelines.execution.studies.untrained_reference`) — logs it on every study run of that
dataset and network as ``untrained.<metric>`` (:data:`UNTRAINED_PREFIX`) and prints it as a reference row; ``dmlrc
report`` shows it the same way. A study whose results are close to this row learned little.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["UNTRAINED_PREFIX", "untrained_key", "untrained_metrics_of"]

#: Prefix of the untrained network's test metrics on a study run (``untrained.map_at_r``, ...).
UNTRAINED_PREFIX = "untrained."


def untrained_key(plan) -> tuple[str, str]:
    """What the untrained score depends on: the dataset and the network's settings (trunk, pooling, embedding, ...);
    studies of one dataset and one network share one computation."""
    return plan.dataset.spec.name, json.dumps(plan.model_kwargs, sort_keys=True, default=str)


def untrained_metrics_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The ``untrained.*`` metrics of a run's metric dict, without the prefix."""
    return {k[len(UNTRAINED_PREFIX) :]: v for k, v in metrics.items() if k.startswith(UNTRAINED_PREFIX)}
