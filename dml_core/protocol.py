"""The Metric Learning Reality Check's shared training recipe: the settings every loss is compared under.

Musgrave, Belongie & Lim, "A Metric Learning Reality Check", ECCV 2020 (MLRC) trained every loss with the same
batch composition, the same embedding model and the same loss-parameter optimiser, so that the comparison measures
the loss and nothing else.  Those settings live here, in a module that imports nothing but the standard library,
because both the training loop (:mod:`dml_core.training.loop`) and the loss registry (:mod:`dml_core.losses.registry`)
need them and neither may import the other at module level (the registry's package imports the whole loss zoo).

The registry re-exports every name below, so ``from dml_core.losses import MLRC_BATCH`` keeps working; see
``docs/losses.md`` ("shared setting") for how a sweep chooses between these and a loss's own recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BatchSpec",
    "ModelRecipe",
    "MLRC_PAPER",
    "MLRC_BATCH",
    "MLRC_MODEL",
    "MLRC_LOSS_WEIGHT_DECAY",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

#: The input normalisation of torchvision's ImageNet weights (RGB, values in [0, 1]): the data transforms' default,
#: and what every trunk without a preprocessing of its own expects (dml_core.trunks.Preprocessing).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class BatchSpec:
    """Batch composition: ``classes_per_batch`` classes × ``m`` samples each."""

    classes_per_batch: int = 8
    m: int = 4
    #: Group Loss: labelled anchors per class inside the batch (0 = not used).
    anchors_per_class: int = 0


@dataclass(frozen=True)
class ModelRecipe:
    """How the paper builds the embedding model around the trunk."""

    pooling: str = "avg"  # a dml_core.models pooling: "avg" | "max" | "avg+max" | "gem[:P]" | "kmax:K"
    layer_norm: bool = False


#: The protocol every loss is compared under (and the paper whose settings the baselines use).
MLRC_PAPER = "Musgrave, Belongie & Lim, A Metric Learning Reality Check, ECCV 2020"
#: MLRC's batch: PML MPerClassSampler(m=4), batch 32 -> 8 classes x 4.
MLRC_BATCH = BatchSpec(classes_per_batch=8, m=4)
#: MLRC's model: BN-Inception global average pool -> one linear layer, no LayerNorm.
MLRC_MODEL = ModelRecipe(pooling="avg", layer_norm=False)
#: MLRC's loss-parameter optimiser (``metric_loss_optimizer``): RMSprop with weight decay 1e-4.  The default
#: ``loss_weight_decay`` of every registered loss and of any other module :func:`dml_core.training.loop.train_fold`
#: trains.
MLRC_LOSS_WEIGHT_DECAY = 1e-4
