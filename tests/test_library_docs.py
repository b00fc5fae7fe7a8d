"""docs/losses/*.md: every sentence that states which pooling a loss's recipe *declares* agrees with the registry's
ModelRecipe (issue 11.4: the MPA page said average pooling in one place and GeM in another)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dml_core.losses import list_losses, loss_info

PAGES = sorted((Path(__file__).resolve().parents[1] / "docs" / "losses").glob("*.md"))
#: How the pages name a pooling (dml_core.models names -> prose).
PROSE = {"avg": "average", "max": "max", "avg+max": "avg+max", "gem": "gem"}
#: Groups the prose names by a word rather than by backticked registry names.
FAMILIES = {"MPA family": ("mpa", "mpa_dw", "mpa_ap")}


def _clauses(text: str) -> list[str]:
    """Sentences and ;-clauses of the prose (tables left out) that state what a recipe declares."""
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    out = []
    for paragraph in re.split(r"\n\s*\n", prose):
        out += re.split(r"(?<=[.;])\s", " ".join(paragraph.split()))
    return [c for c in out if "declare" in c and "pooling" in c]


def _pooling_words(clause: str) -> set[str]:
    words = {w.lower() for w in re.findall(r"(average|avg\+max|max|GeM)\s+pooling", clause, flags=re.I)}
    return {"gem" if w == "gem" else w for w in words}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_declared_pooling_matches_the_model_recipe(page):
    known = set(list_losses())
    checked = 0
    for clause in _clauses(page.read_text(encoding="utf-8")):
        names = {n for n in re.findall(r"`(\w+)`", clause) if n in known}
        for family, members in FAMILIES.items():
            if family in clause:
                names |= set(members)
        said = _pooling_words(clause)
        if not names or not said:
            continue
        for name in names:
            assert PROSE[loss_info(name).model.pooling.split(":")[0]] in said, (
                f"{page.name}: {clause!r} says {sorted(said)} pooling for {name!r}, "
                f"whose ModelRecipe has pooling={loss_info(name).model.pooling!r}"
            )
            checked += 1
    if page.name == "multi_proxy_anchor.md":
        assert checked >= 5, "the MPA page no longer states the family's declared pooling"
