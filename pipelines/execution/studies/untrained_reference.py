"""The untrained network's test metrics of a study (:mod:`pipelines.results.untrained`): one embedding pass of the
test classes on the sweep's driver, with the network's initial weights."""

from __future__ import annotations

import torch

from dml_core.data import ImageDataset, eval_transform
from dml_core.evaluation.metrics import retrieval_metrics
from dml_core.models import build_model
from dml_core.training.loop import embed

__all__ = ["untrained_test_metrics"]


def untrained_test_metrics(plan, seed: int, *, batch_size: int = 256, device: str = "cpu") -> dict[str, float]:
    """Test-class retrieval metrics of the study's network with its initial weights (seeded), compared to self,
    embedded on ``device``.

    The caller's global RNG state is left as it was (the network is built under ``torch.random.fork_rng``)."""
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
