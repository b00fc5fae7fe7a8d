"""Every tune_spaces/*.yaml parses, names a registered loss, and builds at its defaults and every bound."""

from __future__ import annotations

import math

import pytest
import torch

from dml_core.losses import build_loss, list_losses, list_wrappers, loss_info
from pipelines.config.spaces import LOSS_LR, SearchSpace, SpaceError, all_spaces, load_space

SPACES = all_spaces()


def test_every_registered_loss_has_a_space():
    missing = sorted(set(list_losses()) - set(SPACES))
    assert not missing, f"losses without tune_spaces/<name>.yaml: {missing}"


def test_every_space_names_a_registered_loss():
    for name, space in SPACES.items():
        loss_info(name)  # raises for an unknown base or wrapper
        if ":" in name:
            assert name.split(":")[0] in list_wrappers()


def test_learnable_losses_search_their_own_learning_rate():
    for name, space in SPACES.items():
        info = loss_info(name)
        if info.own_optimizer:
            p = space.params.get(LOSS_LR)
            assert p is not None, f"{name}: learnable loss without a searched loss_lr"
            assert (p.low, p.high, p.log) == (1e-6, 1.0, True), f"{name}: loss_lr must be log [1e-6, 1]"


CORNERS = [(name, label, values) for name, space in SPACES.items() for label, values in space.corners()]


@pytest.mark.parametrize("name,label,values", CORNERS, ids=[f"{n}[{lab}]" for n, lab, _ in CORNERS])
def test_builds_and_runs_at_defaults_and_bounds(name, label, values):
    torch.manual_seed(0)
    params, _ = SearchSpace.split(values)
    loss = build_loss(name, num_classes=6, embedding_dim=16, **params)
    emb = torch.randn(24, 16, requires_grad=True)
    labels = torch.arange(6).repeat_interleave(4)
    value = loss(emb, labels)
    assert value.dim() == 0 and math.isfinite(value.item()), f"{name} at {label}: {value}"
    value.backward()
    assert torch.isfinite(emb.grad).all()


def test_out_of_range_value_names_the_field():
    space = next(s for s in SPACES.values() if any(p.type == "float" for p in s.params.values()))
    pname, p = next((n, p) for n, p in space.params.items() if p.type == "float")
    with pytest.raises(SpaceError, match=rf"params\.{pname}: .* outside the search space"):
        space.check({pname: p.high * 10 + 1})


def test_malformed_file_errors_name_file_and_field(tmp_path):
    (tmp_path / "bad.yaml").write_text("loss: triplet\nspace:\n  margin: {low: 2.0, high: 1.0}\n")
    with pytest.raises(SpaceError, match=r"bad.yaml: space.margin: low \(2.0\) must be < high \(1.0\)"):
        all_spaces(tmp_path)
    (tmp_path / "bad.yaml").write_text("loss: triplet\nspace:\n  margin: {low: 0.0, high: 1.0, log: true}\n")
    with pytest.raises(SpaceError, match="log-scale range needs low > 0"):
        all_spaces(tmp_path)
    (tmp_path / "bad.yaml").write_text("loss: triplet\nspace:\n  margin: {low: 0.0, hi: 1.0}\n")
    with pytest.raises(SpaceError, match=r"unknown key\(s\) \['hi'\]"):
        all_spaces(tmp_path)
    (tmp_path / "bad.yaml").write_text("loss: triplet\nspace:\n  margin: {low: 0.0, high: 1.0}\npaper_defaults:\n  margin: 5\n")
    with pytest.raises(SpaceError, match=r"paper_defaults.margin: 5 is outside"):
        all_spaces(tmp_path)
    (tmp_path / "bad.yaml").unlink()
    with pytest.raises(SpaceError, match="no search space for loss 'nope'"):
        load_space("nope", tmp_path)


@pytest.mark.parametrize("name", sorted(SPACES))
def test_every_searched_parameter_has_a_paper_default_inside_its_bounds(name):
    """A direct caller (and the sweep's 'defaults' corner) gets a sourced value, never a midpoint or a library
    fallback such as TrainConfig.loss_lr (issue 11.4)."""
    space = SPACES[name]
    missing = sorted(set(space.params) - set(space.paper_defaults))
    assert not missing, f"{space.path.name}: searched without a paper_defaults value: {missing}"
    for key, p in space.params.items():
        value = space.paper_defaults[key]
        assert p.contains(value), f"{space.path.name}: {key}={value!r} outside {p.describe()}"


def test_every_paper_default_is_commented_with_its_source():
    """Each paper_defaults line (or the comment block just above it) cites a spec/paper section ('§')."""
    for name, space in SPACES.items():
        lines = space.path.read_text(encoding="utf-8").splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("paper_defaults:"))
        comment_above = False
        for line in lines[start + 1:]:
            if not line.startswith(" "):
                break
            if line.strip().startswith("#"):
                comment_above = comment_above or "§" in line or "Table" in line
                continue
            cited = "§" in line or "Table" in line or comment_above or "MLRC" in line
            assert cited, f"{space.path.name}: paper_defaults line without a source: {line.strip()!r}"
            comment_above = False
