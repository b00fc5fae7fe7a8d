"""Every tune_spaces/*.yaml parses, names a registered loss, and builds at its defaults and every bound."""

from __future__ import annotations

import math
import re
from pathlib import Path

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
    (tmp_path / "bad.yaml").write_text(
        "loss: triplet\nspace:\n  margin: {low: 0.0, high: 1.0}\npaper_defaults:\n  margin: 5\n"
    )
    with pytest.raises(SpaceError, match=r"paper_defaults.margin: 5 is outside"):
        all_spaces(tmp_path)
    (tmp_path / "bad.yaml").unlink()
    with pytest.raises(SpaceError, match="no search space for loss 'nope'"):
        load_space("nope", tmp_path)


@pytest.mark.parametrize("name", sorted(SPACES))
def test_every_searched_parameter_has_a_paper_default_inside_its_bounds(name):
    """A direct caller (and the sweep's 'defaults' corner) gets a sourced value, never a midpoint or a library
    fallback such as TrainConfig.loss_lr."""
    space = SPACES[name]
    missing = sorted(set(space.params) - set(space.paper_defaults))
    assert not missing, f"{space.path.name}: searched without a paper_defaults value: {missing}"
    for key, p in space.params.items():
        value = space.paper_defaults[key]
        assert p.contains(value), f"{space.path.name}: {key}={value!r} outside {p.describe()}"


ROOT = Path(__file__).resolve().parents[1]
#: A page of this repository's documentation, e.g. ``docs/protocol.md`` or ``docs/losses/sec.md``.
_DOCS_PAGE = re.compile(r"docs/[\w./-]+\.md")
#: A place in a paper: a section, equation, table, figure or appendix number.
_PAPER_PLACE = re.compile(r"§\s?\d|\bEqs?\.\s?\d|\bTables?\s\d|\bFigs?\.\s?\d|\bApp(?:\.|endix)\s?[\dA-Z]")
#: Which paper: a paper named in the comment.
_PAPER_NAME = re.compile(r"\bpaper\b|\bMLRC\b|\bSEC\b|\bMPA\b|ProxyNCA\+\+|\bRSW\b|Group Loss|et al\.")
#: Sources a reader of the repository cannot open (implementation notes kept outside it).
_UNFOLLOWABLE = re.compile(r"\bspecs?\b|protocol_reality_check|shared/|\bloss_[a-z_]+\.md")


def source_cited(comment: str, root: Path = ROOT) -> bool:
    """Whether ``comment`` names a source a reader of the repository can follow: a ``docs/...md`` page that exists, or
    a place (section, equation, table, figure, appendix) in a paper it names -- and nothing outside the repository."""
    if _UNFOLLOWABLE.search(comment):
        return False
    if any((root / m.group()).is_file() for m in _DOCS_PAGE.finditer(comment)):
        return True
    return bool(_PAPER_PLACE.search(comment) and _PAPER_NAME.search(comment))


def uncited_defaults(text: str, root: Path = ROOT) -> list[str]:
    """The ``paper_defaults`` value lines of a tune file whose comment (on the line, or the comment block just above
    it) does not cite a followable source."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("paper_defaults:"))
    bad, above = [], ""
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        if line.strip().startswith("#"):
            above += " " + line.strip()
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        if not source_cited(comment + above, root):
            bad.append(line.strip())
        above = ""
    return bad


def test_every_paper_default_is_commented_with_its_source():
    """Each paper_defaults line (or the comment block just above it) says where a reader finds the value: a
    ``docs/...md`` page of this repository, or a section / equation / table / figure / appendix of a named paper."""
    for space in SPACES.values():
        bad = uncited_defaults(space.path.read_text(encoding="utf-8"))
        assert not bad, f"{space.path.name}: paper_defaults lines without a followable source: {bad}"


@pytest.mark.parametrize(
    "comment,ok",
    [
        ("MPA paper §4.2: delta = 0.1 in Eqs. 7, 13, 17", True),
        ("SEC paper App. B.1, Table 7: MS, CUB200", True),
        ("MLRC optimum on CUB200 (docs/protocol.md §Baseline optima)", True),
        ("official code, CUB (docs/losses/group_loss.md §Settings)", True),
        ("MLRC optimum on CUB200", False),  # no place to look it up
        ("§2", False),  # a section of what?
        ("docs/nowhere.md §1", False),  # a page that does not exist
        ("spec §2: K = 10 (MPA paper §4.2)", False),  # also cites notes outside the repository
        ("protocol_reality_check.md §4, CUB200 column", False),
    ],
)
def test_source_rule(comment, ok):
    assert source_cited(comment) is ok


def test_a_default_without_its_source_is_reported():
    text = (
        "loss: x\nspace:\n  a: {low: 0, high: 1}\n  b: {low: 0, high: 1}\npaper_defaults:\n"
        "  # MPA paper §4.2\n  a: 0.1\n  b: 0.2   # the usual value\n"
    )
    assert uncited_defaults(text) == ["b: 0.2   # the usual value"]
