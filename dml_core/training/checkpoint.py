"""A fold's full training state on disk or S3, so that a killed fold continues from its last evaluation.

:func:`dml_core.training.loop.train_fold` hands ``on_checkpoint`` a plain dict after every evaluation (its keys are
listed in ``train_fold``'s docstring) and accepts it back as ``resume_state``.  This module turns that dict into bytes
and back, and keeps a directory of them:

* :func:`save_state` / :func:`load_state` — ``torch.save`` / ``torch.load(weights_only=True)``.  Everything in a
  state is a tensor or a plain Python value (RNG states included, see :func:`rng_state`), so the restricted unpickler
  loads it: no code runs when a checkpoint is read.
* :class:`CheckpointDir` — ``<uri>/state-<iteration>.pt`` files plus a ``latest.json`` pointer, written *after* the
  state file it names (write-then-mark: a half-written or never-finished state file is never read).  Only the latest
  state and the one holding the best weights are kept.  The best weights are not copied into every file: at an
  evaluation that is a new best they *are* the model state of that very file, so later files point at it.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import re
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch

from dml_core.storage import open_storage

__all__ = [
    "load_weights_only",
    "STATE_FORMAT",
    "rng_state",
    "set_rng_state",
    "save_state",
    "load_state",
    "state_to_bytes",
    "state_from_bytes",
    "CheckpointDir",
    "LATEST",
]

#: Version of the state layout written by ``train_fold`` (refused on load if different).
STATE_FORMAT = 1
LATEST = "latest.json"


# --------------------------------------------------------------------------------------------- RNG states
def rng_state(device: torch.device | None = None, generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every random stream that can influence the rest of a fold in this process, as tensors and plain values:
    torch's CPU generator (augmentations, dropout), the CUDA generator of ``device``, numpy's and Python's global
    generators (third-party transforms), and ``generator`` (the DataLoader's: it seeds each epoch's workers)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    if generator is not None:
        out["loader"] = generator.get_state()
    return out


def set_rng_state(
    state: dict[str, Any], device: torch.device | None = None, generator: torch.Generator | None = None
) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if generator is not None and "loader" in state:
        generator.set_state(state["loader"])


# --------------------------------------------------------------------------------------------- (de)serialise
def state_to_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


#: torch's reason for refusing a pickle, without its advice to load the file with ``weights_only=False``.
_REFUSED_RE = re.compile(r"WeightsUnpickler error:\s*(.*?)(?:\.?\s+Please use|\n|$)", re.S)


def load_weights_only(f: Any) -> Any:
    """``torch.load(f, map_location="cpu", weights_only=True)`` — tensors and plain values only, never pickled code.
    A file holding anything else raises ``pickle.UnpicklingError`` saying what it holds, and nothing more: torch's own
    message advises retrying with ``weights_only=False`` (running whatever code the file carries), which this
    package never does and never repeats."""
    try:
        with warnings.catch_warnings():
            # torch warns about a pickle protocol other than its own before its unpickler judges the file: the
            # refusal below (or the loaded weights) is the one thing to say
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = _REFUSED_RE.search(str(e))
        reason = " ".join(m.group(1).split()) if m else "it is not a weights-only torch file"
        raise pickle.UnpicklingError(
            f"refused: the file holds more than tensors and plain values ({reason}); only weights are loaded "
            "(weights_only=True), pickled code never runs"
        ) from None


def state_from_bytes(data: bytes) -> dict[str, Any]:
    state = load_weights_only(io.BytesIO(data))
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a training state of format {STATE_FORMAT} (got {got!r})")
    return state


def save_state(state: dict[str, Any], path) -> None:
    """Write a ``train_fold`` state to a local file."""
    torch.save(state, path)


def load_state(path) -> dict[str, Any]:
    """Read a state written by :func:`save_state` (``weights_only=True``: tensors and plain values only)."""
    with open(path, "rb") as f:
        return state_from_bytes(f.read())


# --------------------------------------------------------------------------------------------- directory
class CheckpointDir:
    """The checkpoints of one fold under ``uri`` (a local directory or ``s3://``; :mod:`dml_core.storage`).

    :meth:`save` writes ``state-<iteration>.pt``, then points ``latest.json`` at it, then deletes the files no
    longer needed (all but the latest and the one holding the best weights); :meth:`load` returns the state
    ``latest.json`` names, its best weights filled in, or ``None``.  Storage errors propagate (the caller decides
    whether a failed checkpoint is fatal); a failed pruning is only reported.
    """

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = str(uri)
        self.store = open_storage(self.uri, endpoint_url=endpoint_url)
        #: iteration -> file name of the states known to be complete (written here, or named by the pointer read)
        self._files: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"CheckpointDir({self.uri!r})"

    def latest(self) -> dict[str, Any] | None:
        """The pointer (``file``, ``iteration``, ``epoch``, ``best_file``, ``time``), or ``None`` if none yet."""
        if not self.store.exists(LATEST):
            return None
        return json.loads(self.store.get_bytes(LATEST))

    def load(self, pointer: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The state named by ``pointer`` (default: the current ``latest.json``), or ``None`` if there is none.
        Under DDP rank 0 reads the pointer and every rank loads the state it names (all resume alike)."""
        pointer = pointer if pointer is not None else self.latest()
        if pointer is None:
            return None
        state = state_from_bytes(self.store.get_bytes(pointer["file"]))
        best = dict(state["best"])
        best_file = best.pop("state_file", None)
        if best_file == pointer["file"]:
            best["state"] = {"model": state["model"], "loss": state["loss"]}
        elif best_file is not None:
            other = state_from_bytes(self.store.get_bytes(best_file))
            best["state"] = {"model": other["model"], "loss": other["loss"]}
        state["best"] = best
        self._files = {int(pointer["iteration"]): pointer["file"]}
        if best_file is not None and best_file != pointer["file"]:
            self._files[int(other["iteration"])] = best_file
        return state

    def save(self, state: dict[str, Any]) -> None:
        iteration = int(state["iteration"])
        name = f"state-{iteration:09d}.pt"
        best = dict(state["best"])
        best_it = best.get("iteration")
        best_file = None
        if best.get("state") and best_it is not None:
            # The best weights are the model state of the file written at the best evaluation: point at it when
            # that file is known to exist, else keep them inline (e.g. its upload failed).
            best_file = name if best_it == iteration else self._files.get(int(best_it))
        if best_file is not None:
            best["state"] = {}
        best["state_file"] = best_file
        self.store.put_bytes(state_to_bytes({**state, "best": best}), name)
        self._files[iteration] = name
        pointer = {
            "file": name,
            "iteration": iteration,
            "epoch": int(state["epoch"]),
            "best_file": best_file,
            "time": time.time(),
        }
        self.store.put_bytes(json.dumps(pointer).encode(), LATEST)  # the mark: only now is the new state read
        keep = {name, best_file}
        for it, f in list(self._files.items()):
            if f not in keep:
                try:
                    self.store.delete(f)
                    del self._files[it]
                except Exception as e:  # a stale file costs space, not correctness
                    print(f"checkpoint: could not delete {self.store.uri_of(f)}: {e}", file=sys.stderr)

    def read_json(self, key: str) -> dict[str, Any] | None:
        """A small bookkeeping file next to the states (``None`` if absent)."""
        return json.loads(self.store.get_bytes(key)) if self.store.exists(key) else None

    def write_json(self, key: str, obj: dict[str, Any]) -> None:
        self.store.put_bytes(json.dumps(obj).encode(), key)

    def clear(self) -> None:
        """Delete every file of this directory (the fold finished and its result is stored)."""
        self.store.delete_tree()
        self._files.clear()
