"""The floor a study is measured against: the test-class metrics of its network with its initial weights."""

from __future__ import annotations

import torch

from dml_core.data import ImageDataset, eval_transform
from dml_core.metrics import retrieval_metrics
from dml_core.models import build_model
from dml_core.train import embed

__all__ = ["untrained_test_metrics"]


def untrained_test_metrics(plan, seed: int) -> dict[str, float]:
    """Test-class retrieval metrics of the study's network with its initial weights (seeded), compared to self."""
    torch.manual_seed(seed)
    model = build_model(**plan.model_kwargs)
    data = plan.dataset
    test = ImageDataset(
        data.table.subset(list(data.manifest.test_classes)), eval_transform(data.spec.image_size, model.preprocessing)
    )
    emb, labels = embed(model, test, batch_size=256)
    return retrieval_metrics(emb, labels)
