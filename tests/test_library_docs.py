"""The library's documentation stays consistent with the code and can be followed from it.

* docs/losses/*.md: every sentence that states which pooling a loss's recipe *declares* agrees with the registry's
  ModelRecipe (a page that said average pooling in one place and GeM in another would fail here).
* Every ``docs/<page>.md §<Section>`` citation in the library, the tune files, the sweep configs and the docs names a
  page and a heading that exist, and none of them cites implementation notes kept outside the repository.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from dml_core.losses import list_losses, loss_info

PAGES = sorted((Path(__file__).resolve().parents[1] / "docs" / "losses").glob("*.md"))
#: How the pages name a pooling (dml_core.models names -> prose).
PROSE = {"avg": "average", "max": "max", "avg+max": "avg+max", "gem": "gem"}
#: Groups the prose names by a word rather than by backticked registry names.
FAMILIES = {"MPA family": ("mpa", "mpa_dw", "mpa_ap")}


def _page_losses(text: str, known: set[str]) -> set[str]:
    """The losses a page documents: the known names in the first cell of its table rows."""
    first = (line.split("|")[1] for line in text.splitlines() if line.lstrip().startswith("|") and line.count("|") > 2)
    return {n for cell in first for n in re.findall(r"`(\w+)`", cell) if n in known}


def _statements(text: str, known: set[str]) -> list[tuple[str, set[str]]]:
    """(statement, losses it is about) for every statement of a declared pooling: the prose sentences and ;-clauses
    that say what a recipe declares (a clause naming no loss is about every loss of the page) and the table rows of
    the losses (a row is about the loss in its first cell)."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("|") and line.count("|") > 2:
            names = {n for n in re.findall(r"`(\w+)`", line.split("|")[1]) if n in known}
            if names and "pooling" in line:
                out.append((line, names))
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    everything = _page_losses(text, known)
    for paragraph in re.split(r"\n\s*\n", prose):
        for clause in re.split(r"(?<=[.;])\s", " ".join(paragraph.split())):
            if "pooling" not in clause or not ("declare" in clause or "recipe:" in clause):
                continue
            names = {n for n in re.findall(r"`(\w+)`", clause) if n in known}
            for family, members in FAMILIES.items():
                if family in clause:
                    names |= set(members)
            out.append((clause, names or everything))
    return out


def _pooling_words(statement: str) -> set[str]:
    words = {w.lower() for w in re.findall(r"(average|avg\+max|avg|max|GeM)\s+pooling", statement, flags=re.I)}
    return {"average" if w == "avg" else w for w in words}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_declared_pooling_matches_the_model_recipe(page):
    known = set(list_losses())
    checked = set()
    for statement, names in _statements(page.read_text(encoding="utf-8"), known):
        said = _pooling_words(statement)
        if not said:
            continue
        for name in names:
            assert PROSE[loss_info(name).model.pooling.split(":")[0]] in said, (
                f"{page.name}: {statement[:300]!r} says {sorted(said)} pooling for {name!r}, "
                f"whose ModelRecipe has pooling={loss_info(name).model.pooling!r}"
            )
            checked.add(name)
    # every loss a page documents has its declared pooling stated, and checked, somewhere on the page
    missing = _page_losses(page.read_text(encoding="utf-8"), known) - checked
    assert not missing, f"{page.name} does not state the declared pooling of {sorted(missing)}"


def test_the_pooling_check_catches_a_page_that_contradicts_the_recipe(tmp_path, monkeypatch):
    page = next(p for p in PAGES if p.name == "group_loss.md")
    wrong = tmp_path / page.name
    wrong.write_text(
        page.read_text(encoding="utf-8").replace("model recipe: average pooling", "model recipe: max pooling"),
        encoding="utf-8",
    )
    with pytest.raises(AssertionError, match="group_loss"):
        test_declared_pooling_matches_the_model_recipe(wrong)
    silent = tmp_path / "silent.md"
    silent.write_text("| name | paper |\n|---|---|\n| `triplet` | Schroff et al. |\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="does not state the declared pooling"):
        test_declared_pooling_matches_the_model_recipe(silent)


# ---------------------------------------------------------------------------------------------------------------
# citations: "docs/protocol.md §Folds", "docs/losses/sec.md §Base losses", ...

ROOT = Path(__file__).resolve().parents[1]
#: Files whose comments, docstrings and prose cite the documentation.
CITING = sorted(
    [
        *(ROOT / "dml_core").rglob("*.py"),
        *(ROOT / "pipelines").rglob("*.py"),
        *(ROOT / "pipelines").rglob("*.yaml"),
        *(ROOT / "pipelines").rglob("*.md"),
        *(ROOT / "tune_spaces").glob("*.yaml"),
        *(ROOT / "configs").glob("*.yaml"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "bench" / "train_loop_bench.py",
    ]
)
#: A page, then one or more "§Name" on the same line ("docs/protocol.md §Schedule and §Optimisers").
CITATION = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)`?\s*((?:§(?:(?!docs/)[^§\n])*)+)")
#: Citations of implementation notes that are not part of the repository.
OUTSIDE = re.compile(
    r"protocol_reality_check|shared/spec|\bspec\s*§|\bspec\s+`*loss_|\b(?:protocol|SEC|MPA|ProxyNCA\+\+|RSW)"
    r" spec\b|\bMLRC §|\(spec\s|\bthe spec's\b|\bloss_(?:group|multi_proxy_anchor|proxynca_pp|"
    r"realigned_softmax_warping|spherical_embedding_constraint)\b",
    re.IGNORECASE,
)


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a reader reads: for Python the comments and docstrings, otherwise every line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return sorted(out)


def _headings(page: Path) -> list[tuple[str, str]]:
    """(number, title) of every Markdown heading of ``page``; a heading "## 3. Folds" gives ("3", "Folds")."""
    out = []
    for line in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(?:(\d+(?:\.\d+)*)\.?\s+)?(.+?)\s*$", line)
        if m:
            out.append((m.group(1) or "", m.group(2)))
    return out


def _names_a_heading(cited: str, headings: list[tuple[str, str]]) -> bool:
    """Whether the text after a "§" starts with a heading's title (or its number), or is the start of a title."""
    cited = cited.strip()
    lead = re.match(r"[\w@+' -]*", cited).group().strip()
    for number, title in headings:
        if number and re.match(rf"{re.escape(number)}\b", cited):
            return True
        if cited.lower().startswith(title.lower()) or (len(lead) >= 3 and title.lower().startswith(lead.lower())):
            return True
    return False


def test_citing_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in CITING}
    assert {"dml_core/splits.py", "tune_spaces/mpa.yaml", "configs/mlrc-cub200.yaml", "docs/protocol.md"} <= names


@pytest.mark.parametrize("path", CITING, ids=[p.relative_to(ROOT).as_posix() for p in CITING])
def test_section_citations_resolve(path):
    bad = []
    for lineno, line in _prose(path):
        for m in CITATION.finditer(line):
            page = ROOT / "docs" / m.group(1)
            if not page.is_file():
                bad.append(f"{lineno}: docs/{m.group(1)} does not exist")
                continue
            headings = _headings(page)
            for cited in m.group(2).split("§")[1:]:
                if not _names_a_heading(cited, headings):
                    bad.append(f"{lineno}: docs/{m.group(1)} has no section {cited.strip()!r}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", CITING, ids=[p.relative_to(ROOT).as_posix() for p in CITING])
def test_no_citation_outside_the_repository(path):
    bad = [f"{n}: {line.strip()}" for n, line in _prose(path) if OUTSIDE.search(line)]
    assert not bad, f"{path.relative_to(ROOT)} cites notes outside the repository: " + " | ".join(bad[:5])


def test_citation_checks_catch_bad_citations(tmp_path):
    headings = _headings(ROOT / "docs" / "protocol.md")
    assert _names_a_heading("Folds: the layouts", headings)
    assert _names_a_heading("3", headings)
    assert not _names_a_heading("Foldings", headings)
    assert not _names_a_heading("Nonexistent section", headings)
    assert OUTSIDE.search("(spec §1.3)") and OUTSIDE.search("protocol spec §3") and OUTSIDE.search("MLRC §2.2")
    assert not OUTSIDE.search("MLRC paper §3.2; docs/protocol.md §Metrics") and not OUTSIDE.search("spec = resolve(x)")
    code = tmp_path / "m.py"
    code.write_text('"""Doc (spec §1.2)."""\n\nx = "spec §3"  # see (spec §4)\n', encoding="utf-8")
    assert [line for _, line in _prose(code) if OUTSIDE.search(line)] == ["Doc (spec §1.2).", "# see (spec §4)"]
