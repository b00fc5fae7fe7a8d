"""The MLflow pyfunc model of one reproduction: its 4 fold models and how they combine
(docs/protocol.md §Test evaluation).

This file is an MLflow *model from code*: :mod:`pipelines.tracking.model_registry` logs it with
``mlflow.pyfunc.log_model(python_model=<this file>, artifacts=...)``, MLflow copies the file into the model and
executes it on load (``mlflow.models.set_model`` below).  Nothing is unpickled: the weights are ``fold_<k>.pt``
state dicts read with ``torch.load(weights_only=True)`` (``dml_core.training.checkpoint.load_weights_only``) and the
architecture is ``embedder.json`` (``dml_core.models.build_model`` keyword arguments).  Loading needs this project's
``dml_core`` importable: the model carries its wheel (``requirements.txt``, :mod:`pipelines.tracking.model_env`).

Input (:data:`INPUT_DESCRIPTION`; no MLflow input schema can state it, so :func:`as_batch` checks it): one image or
a list of them, each encoded bytes (PNG, JPEG, …), a file path, a uint8 array ``(H, W)`` / ``(H, W, C)`` (C = 1, 3,
4; RGB order) or a PIL image — decoded and put through the model's own preprocessing (the sweep's evaluation
transform at ``S`` = ``image_size`` with the trunk's ``preprocessing``, both in ``embedder.json``); a uint8 array
``(B, H, W, C)`` is a batch of images; a float array ``(B, 3, S, S)`` is taken as already preprocessed (what
:func:`preprocess` returns).  A one-column DataFrame (MLflow's serving) holds images in its column.
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
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel
from PIL import Image

from dml_core.data import decode_image, eval_transform
from dml_core.models import build_model
from dml_core.training.checkpoint import load_weights_only
from pipelines.results.embeddings import concatenated_embeddings

EMBEDDER_FILE = "embedder.json"
OUTPUTS = ("concatenated", "folds")
#: What ``predict`` takes (the model's ``input`` metadata; ``{size}`` = ``image_size``).
INPUT_DESCRIPTION = (
    "one image or a list of images: encoded bytes, file paths, uint8 arrays (H, W[, C]) or PIL images, decoded and "
    "preprocessed by the model; a uint8 array (B, H, W, C); or float32 (B, 3, {size}, {size}) already preprocessed"
)


def fold_artifact(k: int) -> str:
    return f"fold_{k}"


def preprocess(images, image_size: int, preprocessing: dict | None = None) -> np.ndarray:
    """Images (encoded bytes / paths / uint8 arrays / PIL images) → the model's input ``(B, 3, S, S)`` float32, with
    the sweep's eval transform and the trunk's input convention (``embedder.json``'s ``preprocessing``; ``None`` =
    ImageNet mean/std, RGB)."""
    tf = eval_transform(image_size, preprocessing)
    out = []
    for i, im in enumerate(images):
        try:
            if isinstance(im, Image.Image):
                im.load()
                pil = im if im.mode == "RGB" else im.convert("RGB")
            else:
                pil = decode_image(im)
        except (OSError, ValueError, TypeError) as e:
            # the message names the image by its position and kind, never by its bytes
            raise ValueError(f"image {i} ({_kind(im)}): {type(e).__name__}: {_first_line(e)}") from None
        out.append(tf(pil))
    return torch.stack(out).numpy().astype(np.float32)


def _kind(obj) -> str:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return f"{len(obj)} bytes"
    if isinstance(obj, np.ndarray):
        return f"array {obj.dtype} {obj.shape}"
    if isinstance(obj, (str, os.PathLike)):
        return f"path {os.fspath(obj)!r}"[:300]
    return type(obj).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _is_image(obj) -> bool:
    if isinstance(obj, (bytes, bytearray, memoryview, str, os.PathLike)):
        return True
    if isinstance(obj, np.ndarray):
        return obj.dtype == np.uint8 and (obj.ndim == 2 or (obj.ndim == 3 and obj.shape[2] in (1, 3, 4)))
    return type(obj).__module__.startswith("PIL.")


def as_batch(model_input, image_size: int, preprocessing: dict | None = None) -> np.ndarray:
    """``predict``'s input (see the module's docstring) as the model's float32 ``(B, 3, S, S)`` batch.  Anything
    else is a ``ValueError`` that describes the input by its type and shape, never by its content."""
    if isinstance(model_input, dict) and len(model_input) == 1:  # {"images": ...}: a named input
        model_input = next(iter(model_input.values()))
    if isinstance(model_input, torch.Tensor):
        model_input = model_input.detach().cpu().numpy()
    if type(model_input).__name__ == "DataFrame" and hasattr(model_input, "columns"):
        if len(model_input.columns) != 1:
            raise ValueError(f"a DataFrame input must have one column of images, got {list(model_input.columns)}")
        model_input = list(model_input.iloc[:, 0])
    elif type(model_input).__name__ == "Series":
        model_input = list(model_input)
    if isinstance(model_input, np.ndarray) and np.issubdtype(model_input.dtype, np.floating):
        want = (3, image_size, image_size)
        if model_input.ndim != 4 or tuple(model_input.shape[1:]) != want:
            raise ValueError(
                f"a float array is taken as a preprocessed batch (B, {', '.join(map(str, want))}); got shape "
                f"{model_input.shape} (pass images as uint8 arrays, bytes, paths or PIL images to have them "
                "preprocessed)"
            )
        return model_input.astype(np.float32, copy=False)
    if isinstance(model_input, np.ndarray) and model_input.dtype == np.uint8 and model_input.ndim == 4:
        model_input = list(model_input)  # (B, H, W, C): a batch of images
    if _is_image(model_input):
        model_input = [model_input]
    if not isinstance(model_input, (list, tuple)):
        raise ValueError(
            f"cannot embed a {_kind(model_input)}: give an image (encoded bytes, a path, a uint8 array, a PIL image) "
            "or a list of them"
        )
    for i, im in enumerate(model_input):
        if not _is_image(im):
            raise ValueError(
                f"image {i} is a {_kind(im)}: images are encoded bytes, paths, uint8 arrays (H, W[, C]) or PIL images"
            )
    if not model_input:
        return np.zeros((0, 3, image_size, image_size), np.float32)
    return preprocess(model_input, image_size, preprocessing)


class FoldEnsembleEmbedder(PythonModel):
    """``predict(images) -> embeddings`` for the 4 fold models of one reproduction."""

    def load_context(self, context) -> None:
        spec = json.loads(Path(context.artifacts[EMBEDDER_FILE.split(".")[0]]).read_text())
        self.spec = spec
        self.device = os.environ.get("DMLRC_PYFUNC_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.models = []
        for k in range(int(spec["folds"])):
            state = load_weights_only(context.artifacts[fold_artifact(k)])
            # The logged state dict holds every weight: the trunk's pretrained file is never needed (nor read).
            model = build_model(**{**spec["model_kwargs"], "pretrained": None})
            model.load_state_dict(state)
            self.models.append(model.to(self.device).eval())

    # ``model_input`` is any input :func:`as_batch` takes.  The ``np.ndarray`` hint is one MLflow reads as "no schema
    # from hints" and passes the input through untouched; without a hint MLflow prints an "add type hints" warning at
    # every load of this model (sweep check, reeval actors), and ``Any`` draws another.
    def predict(self, context, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        params = params or {}
        output = params.get("output", "concatenated")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        batch = int(params.get("batch_size", 256))
        x = as_batch(model_input, int(self.spec["image_size"]), self.spec.get("preprocessing"))
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


set_model(FoldEnsembleEmbedder())
