"""The tiny sweep config of the suite's real sweeps: a synthetic dataset of 32 classes × 8 images of 16 px, the
``tiny`` trunk, two or four folds of 4 iterations per epoch, one trial and two reproductions per study — seconds per
fold on a CPU, and still every stage of the protocol (search, reproductions, test, report).

    path = tiny_sweep(tmp_path, "e2e", ["contrastive"], protocol={"trials": 2}, tracking={...})

``protocol`` entries replace the defaults' (``train`` as a whole); other keyword arguments replace or add top-level
keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["tiny_sweep", "tiny_sweep_doc"]


def tiny_sweep_doc(name: str, losses: list[str], *, protocol: dict[str, Any] | None = None, **top: Any) -> dict:
    """The config as a dict (module docstring)."""
    return {
        "name": name,
        "seed": 3,
        "datasets": [{"name": "synthetic", "kind": "synthetic", "num_classes": 32, "per_class": 8, "image_size": 16}],
        "losses": list(losses),
        "model": {"trunk": "tiny", "embedding_dim": 16, "freeze_bn": False},
        "protocol": {
            "folds": 2,
            "fold_layout": "kfold",
            "trials": 1,
            "startup_trials": 1,
            "reproductions": 2,
            "iters_per_epoch": 4,
            "eval_every": 1,
            "patience": 1,
            "max_epochs": 2,
            "train": {"classes_per_batch": 8, "m": 4, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
            **(protocol or {}),
        },
        **top,
    }


def tiny_sweep(
    tmp: Path, name: str, losses: list[str], *, filename: str | None = None, protocol: dict | None = None, **top: Any
) -> Path:
    """The config written to ``tmp / filename`` (default ``<name>.yaml``), with ``storage`` under ``tmp/runs``
    unless given; returns its path."""
    doc = tiny_sweep_doc(name, losses, protocol=protocol, **{"storage": str(tmp / "runs"), **top})
    path = tmp / (filename or f"{name}.yaml")
    path.write_text(yaml.safe_dump(doc))
    return path
