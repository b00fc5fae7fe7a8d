"""Embedding a registered model version's test images with Ray Data, as ``dmlrc reeval`` does.

Ray Data streams the dataset's parquet shards (``read_parquet`` → filter to the test classes → ``map_batches`` with
:class:`Embedder` actors that hold every reproduction's pyfunc model, one actor per GPU with ``use_gpu``) and returns
only the embeddings to the driver.  :func:`start_ray` is the sweep's Ray start-up with every core for those actors.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import mlflow
import numpy as np
import pyarrow.fs as pafs
import ray
import ray.data

from pipelines.execution.runtime.interrupts import install_startup_handlers
from pipelines.execution.runtime.session import init_ray
from pipelines.reeval.config import ReevalConfig, Target
from pipelines.tracking.pyfunc_model import preprocess

__all__ = ["Embedder", "embed_version", "start_ray"]


class Embedder:
    """Ray Data actor: every reproduction's pyfunc model of one version, loaded once per actor."""

    def __init__(self, tracking_uri: str, model_uris: list[str], image_size: int, batch_size: int):
        mlflow.set_tracking_uri(tracking_uri)
        self.models = [mlflow.pyfunc.load_model(u) for u in model_uris]
        self.image_size, self.batch_size, self.preprocess = image_size, batch_size, preprocess
        # the trunk's input convention, as the sweep trained it (embedder.json; ImageNet RGB for older versions)
        self.preprocessing = self.models[0].unwrap_python_model().spec.get("preprocessing")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = list(batch["image"])
        for img, digest, rel in zip(images, batch["sha256"], batch["relpath"]):
            if hashlib.sha256(img).hexdigest() != digest:
                raise ValueError(f"{rel}: image bytes do not match their sha256 (corrupt shard)")
        x = self.preprocess(images, self.image_size, self.preprocessing)
        out = {"label": np.asarray(batch["label"], dtype=np.int64)}
        for i, m in enumerate(self.models):
            out[f"rep{i}"] = np.asarray(
                m.predict(x, params={"output": "folds", "batch_size": self.batch_size}), dtype=np.float32
            )
        return out


def _filesystem(uri: str):
    """pyarrow filesystem + paths root for Ray Data (S3 endpoint from $AWS_ENDPOINT_URL[_S3] as the sweep uses it)."""
    if not uri.startswith("s3://"):
        return None, uri.rstrip("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), uri[len("s3://") :].rstrip("/")


def embed_version(t: Target, cfg: ReevalConfig) -> tuple[list[np.ndarray], np.ndarray, float]:
    """``([reproduction i's "folds" output (N, 4·d)], labels (N,), seconds)`` over the test classes, streamed."""
    root = t.dataset_uri
    if root.endswith(".json"):
        root = root.rsplit("/", 1)[0]
    fs, base = _filesystem(root)
    paths = [f"{base}/{s['path']}" for s in t.manifest["shards"]]
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the sweep embedded the test rows in shard order
    classes = set(t.test_classes)
    ds = ray.data.read_parquet(paths, filesystem=fs, columns=["image", "label", "sha256", "relpath"])
    ds = ds.filter(lambda row: int(row["label"]) in classes)
    n_gpu = int(ray.cluster_resources().get("GPU", 0)) if cfg.use_gpu else 0
    actors = max(1, n_gpu) if cfg.use_gpu else max(1, min(2, int(ray.cluster_resources().get("CPU", 1)) // 2))
    uris = [r["model_uri"] for r in t.reproductions]
    t0 = time.time()
    ds = ds.map_batches(
        Embedder,
        fn_constructor_args=(cfg.tracking_uri, uris, int(t.tags.get("image_size", 227)), cfg.batch_size),
        batch_size=cfg.batch_size,
        concurrency=actors,
        num_gpus=1 if cfg.use_gpu else 0,
        batch_format="numpy",
    )
    labels: list[np.ndarray] = []
    reps: list[list[np.ndarray]] = [[] for _ in uris]
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        labels.append(batch["label"])
        for i in range(len(uris)):
            reps[i].append(batch[f"rep{i}"])
    seconds = time.time() - t0
    if not labels:
        raise RuntimeError(f"{t.dataset_uri}: no rows of the test classes")
    return [np.concatenate(r) for r in reps], np.concatenate(labels), seconds


def start_ray(cfg: ReevalConfig) -> bool:
    """The sweep's Ray start-up (:func:`pipelines.execution.runtime.session.init_ray`: loopback only, credentials kept
    out of Ray's runtime_env, quiet loggers); a local Ray gets every core (embedding actors, one per CPU slot)."""
    started = init_ray(cfg.ray_address, num_cpus=max(2, os.cpu_count() or 1), address_field="ray_address")
    install_startup_handlers()  # Ray's driver installs a native SIGTERM handler: a CronJob's SIGTERM stays ours
    ray.data.DataContext.get_current().enable_progress_bars = False
    return started
