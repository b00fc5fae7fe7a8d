"""The MLflow pyfunc model of one reproduction: its 4 fold models and how they combine
(docs/protocol.md §Test evaluation).

This file is an MLflow *model from code*: :mod:`pipelines.tracking.model_registry` logs it with
``mlflow.pyfunc.log_model(python_model=<this file>, artifacts=...)``, MLflow copies the file into the model and
executes it on load (``mlflow.models.set_model`` below).  Nothing is unpickled: the weights are ``fold_<k>.pt``
state dicts read with ``torch.load(weights_only=True)`` and the architecture is ``embedder.json``
(``dml_core.models.build_model`` keyword arguments).  Loading needs this project's ``dml_core`` importable.

Input (signature): float32 tensor ``(B, 3, S, S)`` of images after ``dml_core.data.eval_transform(S, P)``
(``S`` = ``image_size``, ``P`` = the trunk's ``preprocessing`` in ``embedder.json``); use :func:`preprocess` for
encoded image bytes.
Output, by the ``output`` parameter:

* ``concatenated`` (default) — the MLRC "concatenated" embedding ``(B, 4·d)``: each fold model's embedding
  L2-normalised, then concatenated (``pipelines.results.embeddings.concatenated_embeddings``, the sweep's own function);
* ``folds`` — the raw fold embeddings side by side ``(B, 4·d)``: columns ``k·d:(k+1)·d`` are fold model ``k``
  ("separated": each fold model alone), exactly what the sweep's test step fed to ``retrieval_metrics``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dml_core.models import build_model
from pipelines.results.embeddings import concatenated_embeddings

EMBEDDER_FILE = "embedder.json"
OUTPUTS = ("concatenated", "folds")

try:  # MLflow is only needed to be loaded *as* a pyfunc; the helpers below work without it.
    import mlflow.pyfunc

    _Base = mlflow.pyfunc.PythonModel
except ImportError:  # pragma: no cover - mlflow is a dependency of pipelines/
    _Base = object


def fold_artifact(k: int) -> str:
    return f"fold_{k}"


def preprocess(images, image_size: int, preprocessing: dict | None = None) -> np.ndarray:
    """Encoded images (bytes / paths / uint8 arrays) → the model's input, with the sweep's eval transform and the
    trunk's input convention (``embedder.json``'s ``preprocessing``; ``None`` = ImageNet mean/std, RGB)."""
    # PIL and the transforms only for callers with encoded images: loading or serving the model does not need them
    from dml_core.data import decode_image, eval_transform

    tf = eval_transform(image_size, preprocessing)
    return torch.stack([tf(decode_image(im)) for im in images]).numpy().astype(np.float32)


class FoldEnsembleEmbedder(_Base):
    """``predict(images) -> embeddings`` for the 4 fold models of one reproduction."""

    def load_context(self, context) -> None:
        spec = json.loads(Path(context.artifacts[EMBEDDER_FILE.split(".")[0]]).read_text())
        self.spec = spec
        self.device = os.environ.get("DMLRC_PYFUNC_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.models = []
        for k in range(int(spec["folds"])):
            state = torch.load(context.artifacts[fold_artifact(k)], map_location="cpu", weights_only=True)
            # The logged state dict holds every weight: the trunk's pretrained file is never needed (nor read).
            model = build_model(**{**spec["model_kwargs"], "pretrained": None})
            model.load_state_dict(state)
            self.models.append(model.to(self.device).eval())

    # The ``np.ndarray`` hint is one MLflow reads as "no schema from hints" (the logged signature applies); without
    # a hint MLflow prints an "add type hints" warning at every load of this model (sweep check, reeval actors).
    def predict(self, context, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        params = params or {}
        output = params.get("output", "concatenated")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        batch = int(params.get("batch_size", 256))
        if isinstance(model_input, dict):  # a named tensor input arrives as {"images": array}
            model_input = model_input["images"] if "images" in model_input else next(iter(model_input.values()))
        x = np.asarray(model_input, dtype=np.float32)
        parts = []
        with torch.inference_mode():
            for model in self.models:
                chunks = [
                    model(torch.from_numpy(x[i : i + batch]).to(self.device)).float().cpu().numpy()
                    for i in range(0, len(x), batch)
                ]
                d = int(self.spec["embedding_dim"])
                parts.append(np.concatenate(chunks) if chunks else np.zeros((0, d), np.float32))
        if output == "folds":
            return np.concatenate(parts, axis=1)
        return concatenated_embeddings(parts)


if _Base is not object:
    from mlflow.models import set_model

    set_model(FoldEnsembleEmbedder())
