"""The tiny sweep config of the suite's real sweeps: a synthetic dataset of 32 classes × 8 images of 16 px, the
``tiny`` trunk, two or four folds of 4 iterations per epoch, one trial and two reproductions per study — seconds per
fold on a CPU, and still every stage of the protocol (search, reproductions, test, report).

    path = tiny_sweep(tmp_path, "e2e", ["contrastive"], protocol={"trials": 2}, tracking={...})

``protocol`` entries replace the defaults' (``train`` as a whole); other keyword arguments replace or add top-level
keys.  :func:`smallest_sweep` is smaller still (one loss, 16 classes, 2 iterations an epoch) for the tests whose
subject is a sweep's process (security, interrupts, resume); :func:`sweep_env` and :func:`ray_tmpdir` give such a
sweep's subprocess this checkout and a Ray temp dir of its own, which :func:`files_containing` can then search.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

__all__ = ["tiny_sweep", "tiny_sweep_doc", "smallest_sweep", "sweep_env", "ray_tmpdir", "files_containing"]

ROOT = Path(__file__).resolve().parents[1]


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


def smallest_sweep(
    tmp_path: Path,
    tracking_uri: str,
    *,
    name: str,
    max_epochs: int = 1,
    iters_per_epoch: int = 2,
    trunk: str = "tiny",
    **resources: Any,
) -> Path:
    """The smallest real sweep: 1 loss, 2 kfold folds, 1 trial + 2 reproductions, 1 gloo worker per fold."""
    return tiny_sweep(
        tmp_path,
        name,
        ["contrastive"],
        seed=1,
        datasets=[{"name": "synthetic", "kind": "synthetic", "num_classes": 16, "per_class": 6, "image_size": 16}],
        model={"trunk": trunk, "embedding_dim": 8, "freeze_bn": False},
        protocol={
            "iters_per_epoch": iters_per_epoch,
            "max_epochs": max_epochs,
            "train": {"classes_per_batch": 4, "m": 2, "trunk_lr": 1e-3, "embedder_lr": 1e-3, "eval_batch_size": 64},
        },
        resources={"workers_per_fold": 1, "max_concurrent_trials": 1, **resources},
        tracking={"uri": tracking_uri, "experiment": f"{name}-experiment"},
    )


def sweep_env(ray_tmp: str, **extra: str) -> dict[str, str]:
    """The test's environment for a sweep subprocess: this checkout first, its own Ray temp dir."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_TMPDIR"] = ray_tmp
    env.update(extra)
    return env


def ray_tmpdir() -> str:
    """A short private directory for Ray (its unix sockets live under it: paths must stay < 108 bytes)."""
    return tempfile.mkdtemp(prefix="dmlrc-ray-")


def files_containing(root: Path, needles: list[bytes]) -> list[str]:
    """Every file under ``root`` whose bytes contain one of ``needles`` (binary files included)."""
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if any(n in data for n in needles):
                hits.append(str(p))
    return hits
