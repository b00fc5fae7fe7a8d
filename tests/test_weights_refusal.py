"""A weights file or training state that holds pickled objects is refused (``weights_only=True``) with what it holds,
and never with torch's advice to load it with ``weights_only=False`` (which would run the file's code)."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from dml_core.training.checkpoint import load_state
from dml_core.trunks.weights import read_state_dict


class NotATensor:
    """A class of this test module: torch's weights-only unpickler refuses it."""


def _pickled(path):
    torch.save({"format": 1, "conv.weight": torch.zeros(2), "extra": NotATensor()}, path)
    return path


def _no_advice(text: str) -> None:
    assert "weights_only" not in text.replace("weights_only=True", "")  # neither `False` nor "set weights_only ..."
    assert "arbitrary code" not in text and "add_safe_globals" not in text and "trust" not in text


def test_pretrained_weights_with_a_pickled_object_are_refused_without_torchs_advice(tmp_path):
    with pytest.raises(ValueError) as info:
        read_state_dict(_pickled(tmp_path / "w.pt"))
    text = str(info.value)
    assert "could not be read as a state_dict" in text and "NotATensor" in text
    _no_advice(text)


def test_a_training_state_with_a_pickled_object_is_refused_without_torchs_advice(tmp_path):
    with pytest.raises(pickle.UnpicklingError) as info:
        load_state(_pickled(tmp_path / "state.pt"))
    assert "refused: the file holds more than tensors and plain values" in str(info.value)
    _no_advice(str(info.value))


def test_plain_weights_still_load(tmp_path):
    torch.save(collections.OrderedDict(w=torch.ones(3)), tmp_path / "w.pt")
    assert torch.equal(read_state_dict(tmp_path / "w.pt")["w"], torch.ones(3))
