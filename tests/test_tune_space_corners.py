"""No built-in search space reaches a value its loss calls meaningless: every loss is built and run at each bound of
each searched parameter (the others at their paper defaults) and at every combination of bounds, with warnings as
errors, so a loss that warns ("the negative term can never act") or refuses (ValueError) there fails the test."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from dml_core.losses import build_loss
from pipelines.config.spaces import SearchSpace, builtin_spaces

SPACES = builtin_spaces()


def _points(space: SearchSpace) -> list[tuple[str, dict]]:
    """The paper defaults, each parameter at each bound (others at defaults), and every combination of bounds."""
    ends = {n: (p.choices if p.type == "categorical" else (p.low, p.high)) for n, p in space.params.items()}
    points = list(space.corners())
    for values in itertools.product(*ends.values()):
        assignment = dict(zip(ends, values))
        points.append((",".join(f"{k}={v}" for k, v in assignment.items()), {**space.defaults(), **assignment}))
    return points


POINTS = [(name, label, values) for name, space in sorted(SPACES.items()) for label, values in _points(space)]


def test_the_points_cover_every_builtin_space():
    assert {name for name, _, _ in POINTS} == set(SPACES) and len(SPACES) >= 20


@pytest.mark.parametrize("name", sorted(SPACES))
def test_no_builtin_space_reaches_a_value_its_loss_warns_about_or_refuses(name):
    for label, values in [(lab, v) for n, lab, v in POINTS if n == name]:
        torch.manual_seed(0)
        params, _ = SearchSpace.split(values)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                loss = build_loss(name, num_classes=6, embedding_dim=16, **params)
                emb = torch.randn(24, 16, requires_grad=True)
                value = loss(emb, torch.arange(6).repeat_interleave(4))
                value.backward()
            except (Warning, ValueError) as e:
                pytest.fail(f"{name} at {label}: {type(e).__name__}: {e}")
        assert value.dim() == 0 and math.isfinite(value.item()), f"{name} at {label}: {value}"
        assert torch.isfinite(emb.grad).all(), f"{name} at {label}: non-finite gradient"
