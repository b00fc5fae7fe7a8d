"""Pretrained trunk weights: a local file or an ``s3://`` object, read as a state dict and loaded strictly.

Nothing is downloaded from the internet: a path names a file on this machine (or a mounted file system); an
``s3://bucket/key`` URI is fetched through :mod:`dml_core.storage` (endpoint from ``AWS_ENDPOINT_URL``, credentials
from boto3's chain) into a temporary folder for the duration of the build.  Files are read with
``torch.load(weights_only=True)`` (no pickled code runs) or, for ``*.safetensors``, with the ``safetensors`` package.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from dml_core.storage import is_s3_uri, open_storage, split_s3_uri
from dml_core.training.checkpoint import load_weights_only

__all__ = ["local_weights", "read_state_dict", "load_trunk_weights"]

# Checkpoints that wrap the state dict (training scripts, timm's train.py) keep it under one of these keys.
_WRAPPER_KEYS = ("state_dict", "model", "state_dict_ema")


def _describe(pretrained) -> str:
    return repr(str(pretrained))


@contextlib.contextmanager
def local_weights(pretrained: str | os.PathLike | None, trunk_name: str) -> Iterator[Path | None]:
    """``pretrained`` as a local file for the ``with`` block: ``None`` stays ``None``; a missing local file is a
    ``FileNotFoundError`` naming the path; an ``s3://`` URI is downloaded to a temporary folder removed afterwards."""
    if pretrained is None:
        yield None
        return

    if is_s3_uri(pretrained):
        uri = str(pretrained)
        bucket, key = split_s3_uri(uri)
        if not key:
            raise ValueError(f"pretrained weights URI {uri!r} names a bucket, not an object (trunk {trunk_name!r})")
        parent, name = PurePosixPath(key).parent, PurePosixPath(key).name
        storage = open_storage(f"s3://{bucket}/{parent}" if str(parent) != "." else f"s3://{bucket}")
        if not storage.exists(name):
            raise FileNotFoundError(f"pretrained weights not found: {uri!r} (trunk {trunk_name!r})")
        with tempfile.TemporaryDirectory(prefix="dmlrc-weights-") as tmp:
            local = Path(tmp) / name
            storage.get_file(name, local)
            yield local
        return
    path = Path(pretrained).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights file not found: {str(pretrained)!r} (trunk {trunk_name!r})")
    yield path


def read_state_dict(path: str | os.PathLike, shown: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The state dict in ``path`` (``weights_only`` torch file or ``.safetensors``); a checkpoint that wraps it under
    ``state_dict``/``model``/``state_dict_ema`` is unwrapped.  ``shown`` is how errors name the file (the URI the
    user gave for a downloaded copy).  Anything else is a ``ValueError`` naming the file."""
    shown = _describe(shown if shown is not None else path)
    state: Any  # what the file holds: checked below to be a dict of tensors
    try:
        if str(path).endswith(".safetensors"):
            # safetensors: only .safetensors weight files need it
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = load_weights_only(path)  # torch.load(weights_only=True), refusals without torch's advice
    except Exception as e:  # corrupt file, pickle of something else, missing safetensors package, ...
        raise ValueError(
            f"pretrained weights file {shown} could not be read as a state_dict: {type(e).__name__}: {e}"
        ) from None
    if isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        for key in _WRAPPER_KEYS:
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state) or not state:
        raise ValueError(f"pretrained weights file {shown} does not hold a state_dict (a dict of tensors)")
    return state


def load_trunk_weights(
    module: nn.Module,
    path: str | os.PathLike,
    trunk_name: str,
    *,
    ignore_prefixes: tuple[str, ...] = (),
    shown: str | os.PathLike | None = None,
) -> None:
    """Load the state dict in ``path`` into ``module``: entries under ``ignore_prefixes`` (a classifier head the
    trunk does not have) are dropped, every other entry must match — names and shapes.  A mismatch is a
    ``ValueError`` naming the file, the trunk and the first missing / unexpected / mis-shaped entries."""
    shown_s = _describe(shown if shown is not None else path)
    state = read_state_dict(path, shown)
    state = {k: v for k, v in state.items() if not k.startswith(ignore_prefixes)}
    own = module.state_dict()
    wrong_shape = [
        f"{k} {tuple(v.shape)} (trunk: {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"pretrained weights file {shown_s} does not match trunk {trunk_name!r}: "
            f"{len(missing)} missing entries {missing[:5]}, {len(unexpected)} unexpected entries {unexpected[:5]}"
            + (f", {len(wrong_shape)} entries of another shape {wrong_shape[:3]}" if wrong_shape else "")
        )
    # BatchNorm fills a missing num_batches_tracked itself (state dicts saved before PyTorch 0.4.1 have none).
    module.load_state_dict(state, strict=False)
