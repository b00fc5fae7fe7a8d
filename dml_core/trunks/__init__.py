"""Trunks — the image backbones of :class:`dml_core.models.EmbeddingModel` — and their input conventions.

* :func:`resolve_trunk` (name → :class:`TrunkSpec`), :func:`check_trunk` (config validation, builds nothing),
  :func:`trunk_preprocessing` (name → :class:`Preprocessing`), :func:`list_trunks`.
* Names: the built-ins (:data:`BUILTIN_TRUNKS`: ``tiny``, ``resnet18``, ``resnet50``, ``googlenet``,
  ``bninception``), ``timm:<model>``, an import path ``package.module:callable``, or an installed entry point of
  the group ``dml_reality_check.trunks`` (:data:`ENTRY_POINT_GROUP`).
* :class:`BNInception` — MLRC's trunk, weight-compatible with ``pretrainedmodels.bninception``.

User guide: ``docs/trunks.md``.  Importing this package loads neither timm nor torchvision: they are imported when a
trunk of theirs is resolved or built.
"""

from dml_core.trunks.bninception import BNInception
from dml_core.trunks.builtin import BUILTIN_TRUNKS, TinyCNN
from dml_core.trunks.plugins import ENTRY_POINT_GROUP
from dml_core.trunks.preprocessing import BNINCEPTION_PREPROCESSING, IMAGENET_PREPROCESSING, Preprocessing
from dml_core.trunks.registry import TrunkSpec, check_trunk, list_trunks, resolve_trunk, trunk_preprocessing
from dml_core.trunks.weights import load_trunk_weights, local_weights, read_state_dict

__all__ = [
    "BUILTIN_TRUNKS",
    "ENTRY_POINT_GROUP",
    "BNInception",
    "TinyCNN",
    "Preprocessing",
    "IMAGENET_PREPROCESSING",
    "BNINCEPTION_PREPROCESSING",
    "TrunkSpec",
    "resolve_trunk",
    "check_trunk",
    "trunk_preprocessing",
    "list_trunks",
    "local_weights",
    "read_state_dict",
    "load_trunk_weights",
]
