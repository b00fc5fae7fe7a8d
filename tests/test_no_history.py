"""The repository describes what is true now: the project's history (sessions, issue numbers, people, the machines
earlier runs happened on and what they measured) lives in CHANGELOG.md, and measurements live in bench/README_*.md
with their commands, dates and machines.  Everything else git tracks, code, tests, configs and docs, is checked
here line by line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Where history belongs.
EXEMPT = re.compile(r"^(CHANGELOG\.md|bench/README_[\w-]+\.md|tests/test_no_history\.py)$")
#: Text files read (what git tracks; images and JSON schemas are not prose).
TEXT = re.compile(r"(\.(py|md|ya?ml|toml|cfg|txt|sh|service|timer)|Makefile|Dockerfile|\.ci/run)$")

#: (what it is, pattern): each a sign of a development log rather than a user's or maintainer's guide.
RULES = [
    ("an issue number", re.compile(r"\bissues?\s*#?\d+", re.I)),
    ("a development session", re.compile(r"\bsession\s+\d+|\b(this|previous|earlier|last|an earlier) session\b", re.I)),
    ("a person of the team", re.compile(r"\bengineer [A-Z]\b")),
    ("the VM a run happened on", re.compile(r"\bVMs?\b")),
    (
        "an earlier version's measurement",
        re.compile(
            r"\b(measured|took|ran)\b[^\n]{0,30}\b20\d\d-\d\d-\d\d\b|\bbefore (that|this) change\b|\bused to take\b",
            re.I,
        ),
    ),
]


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): nothing to list the tracked files with")
    return [f for f in out.splitlines() if TEXT.search(f) and not EXEMPT.match(f)]


def offences(path: str, text: str) -> list[str]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in RULES:
            m = pattern.search(line)
            if m:
                found.append(f"{path}:{lineno}: {what} ({m.group(0)!r})")
    return found


def test_no_history_in_code_docs_or_configs():
    files = tracked_files()
    assert len(files) > 100, files  # the listing found the tree
    bad = [
        o
        for f in files
        if (ROOT / f).is_file()
        for o in offences(f, (ROOT / f).read_text(encoding="utf-8", errors="replace"))
    ]
    assert not bad, "history belongs in CHANGELOG.md, measurements in bench/README_*.md:\n" + "\n".join(bad)


def test_the_rules_catch_each_kind_of_history():
    log = (
        "fixed in issue #16\nas session 4 found\nengineer C wrote\non the Zen 3 VM\n"
        "measured (2026-11-24) at 3 s\n88 min before that change\n"
    )
    assert len(offences("README.md", log)) == 6
    assert offences("README.md", "Ray's session dir; MLflow's issues page; 90 minutes on a 2-core machine") == []
    assert not EXEMPT.match("README.md") and EXEMPT.match("bench/README_faults.md") and EXEMPT.match("CHANGELOG.md")
