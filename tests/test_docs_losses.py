"""docs/losses.md indexes every registered loss and wrapper, and its recipe columns and defaults match the code.

The page is hand-written; this test is what keeps it honest when a loss, its metadata (``loss_info``) or its
``tune_spaces`` defaults change.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import pytest

from dml_core.losses import list_losses, list_wrappers, loss_info
from pipelines.config.spaces import all_spaces

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "losses.md"
COLUMNS = [
    "loss",
    "paper, equations",
    "hyperparameters",
    "paper_defaults",
    "batch",
    "model",
    "parameters",
    "loss wd",
    "details",
]


def _rows() -> dict[str, dict[str, str]]:
    """First-column name (without backticks) -> {column: cell} for every row of the page's loss tables."""
    rows: dict[str, dict[str, str]] = {}
    header: list[str] | None = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if header is None:
            header = cells
            continue
        if header != COLUMNS or set("".join(cells)) <= set("-: "):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"docs/losses.md: two rows for {name!r}"
        rows[name] = dict(zip(header, cells))
    return rows


ROWS = _rows()
SPACES = all_spaces()


def _row(name: str) -> dict[str, str]:
    assert name in ROWS, f"{name!r} has no row in docs/losses.md"
    return ROWS[name]


def _numbers(cell: str) -> list[float]:
    """Every number written in a cell (unicode minus, exponents, fractions such as 1/9)."""
    text = cell.replace("−", "-")
    return [float(Fraction(m)) for m in re.findall(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?", text)]


def test_every_registered_loss_and_wrapper_has_exactly_one_row():
    assert ROWS, "docs/losses.md has no table with the expected columns " + str(COLUMNS)
    expected = set(list_losses()) | {f"{w}:<base>" for w in list_wrappers()}
    missing = sorted(expected - set(ROWS))
    stale = sorted(set(ROWS) - expected)
    assert not missing, f"registered but not in docs/losses.md: {missing}"
    assert not stale, f"rows in docs/losses.md for names that are not registered: {stale}"


@pytest.mark.parametrize("name", list_losses())
def test_row_links_the_module_page_and_matches_the_metadata(name):
    row, info = _row(name), loss_info(name)
    module = info.factory.__module__.rsplit(".", 1)[-1]
    assert row["details"] == f"[{module}](losses/{module}.md)"
    assert (ROOT / "docs" / "losses" / f"{module}.md").is_file(), f"docs/losses/{module}.md is missing"

    b = info.batch
    batch = f"{b.classes_per_batch} × {b.m}" + (f" ({b.anchors_per_class} anchors)" if b.anchors_per_class else "")
    assert row["batch"] == batch
    assert row["model"] == info.model.pooling + (" + LN" if info.model.layer_norm else "")
    if info.learnable:
        assert row["parameters"] != "—"
        assert ("own optimiser (`loss_lr`" in row["parameters"]) == info.own_optimizer
        assert float(row["loss wd"]) == info.loss_weight_decay
    else:
        assert row["parameters"] == row["loss wd"] == "—"


@pytest.mark.parametrize("name", list_losses())
def test_row_lists_the_tune_space_paper_defaults(name):
    cell = _row(name)["paper_defaults"]
    alias = re.fullmatch(r"as `(\w+)`", cell)
    if alias:  # "as `mpa`": the two spaces must really agree
        assert SPACES[alias.group(1)].paper_defaults == SPACES[name].paper_defaults
        cell = _row(alias.group(1))["paper_defaults"]
    written = _numbers(cell)
    for key, value in SPACES[name].paper_defaults.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert any(math.isclose(value, w, rel_tol=1e-3) for w in written), f"{name}: {key}={value} not in {cell!r}"


@pytest.mark.parametrize("wrapper", list_wrappers())
def test_wrapper_row_lists_each_wrapped_space_default(wrapper):
    cell = _row(f"{wrapper}:<base>")["paper_defaults"]
    wrapped = {n: s for n, s in SPACES.items() if n.startswith(wrapper + ":")}
    assert wrapped, f"no tune_spaces file for {wrapper}:<base>"
    for name, space in wrapped.items():
        stem = name.replace(":", "_")
        m = re.search(rf"`{stem}` ([^,]+)", cell)
        assert m, f"{wrapper} row does not give the default of {stem}.yaml"
        assert math.isclose(_numbers(m.group(1))[0], space.paper_defaults[f"{wrapper}_eta"], rel_tol=1e-3)
