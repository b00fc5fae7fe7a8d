"""``dmlrc docs``: every page a help text or message points at is one an installed user can open.

The mentions are read from the sources themselves (``docs/<page>.md`` and ``dmlrc docs NAME`` in ``pipelines/`` and
the shipped presets), so a message added tomorrow that names a page not shipped fails here; the slow test builds the
wheel and finds the pages in it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipelines.commands import build_parser, run
from pipelines.docs_cli import DOC_MENTION, resolve_doc, user_docs

ROOT = Path(__file__).resolve().parents[1]
#: ``dmlrc docs NAME`` as help texts and messages write it.
DOCS_COMMAND = re.compile(r"dmlrc docs ([A-Za-z0-9_](?:[A-Za-z0-9_./-]*[A-Za-z0-9_])?)")


def _shipped_sources() -> list[Path]:
    files = [p for p in (ROOT / "pipelines").rglob("*") if p.suffix in (".py", ".yaml") and "user_docs" not in p.parts]
    return files + sorted((ROOT / "configs").glob("*.yaml"))


def _mentions() -> dict[str, set[str]]:
    """Every page mention -> the files that make it."""
    found: dict[str, set[str]] = {}
    for path in _shipped_sources():
        text = path.read_text(encoding="utf-8")
        for m in DOC_MENTION.finditer(text):
            found.setdefault(m.group(0), set()).add(str(path.relative_to(ROOT)))
        for m in DOCS_COMMAND.finditer(text):
            if m.group(1) != "NAME":
                found.setdefault(m.group(1), set()).add(str(path.relative_to(ROOT)))
    return found


def _help_texts() -> list[tuple[str, str]]:
    """(command, text) of every help and description string of every sub-command, unwrapped."""
    out = []

    def walk(parser, path):
        out.append((path, parser.description or ""))
        for action in parser._actions:
            if action.help and action.help != argparse.SUPPRESS:
                out.append((path, action.help))
            if isinstance(action, argparse._SubParsersAction):
                out.extend((path, choice.help or "") for choice in action._choices_actions)
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "dmlrc")
    return out


def test_every_page_the_sources_mention_resolves_and_prints_the_repository_file(capsys):
    mentions = _mentions()
    assert "docs/protocol.md" in mentions and "plan" in mentions, sorted(mentions)  # the scan finds both spellings
    for mention, where in sorted(mentions.items()):
        try:
            name = resolve_doc(mention)
        except Exception as e:
            raise AssertionError(f"{mention!r} (in {sorted(where)}) is not a shipped page: {e}") from None
        assert run(["docs", mention]) == 0
        printed = capsys.readouterr().out
        source = (
            ROOT / "README.md"
            if name == "readme"
            else ROOT / "docs" / (name if name.endswith(".json") else f"{name}.md")
        )
        assert printed == source.read_text(encoding="utf-8"), mention


def test_help_texts_name_pages_through_dmlrc_docs_only():
    texts = _help_texts()
    assert any("dmlrc docs plan" in t for _, t in texts)
    for command, text in texts:
        assert not re.search(r"\bdocs/|\bREADME\b|\binfra/", text), f"{command}: {text!r} names a repository path"
        for m in DOCS_COMMAND.finditer(text):
            if m.group(1) != "NAME":
                resolve_doc(m.group(1))


def test_listing_names_every_page_with_its_title_and_an_unknown_page_is_one_line(capsys):
    assert run(["docs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[1:]}
    assert set(listed) == set(user_docs())
    assert "The reality-check protocol" in listed["protocol"]
    assert "JSON Schema" in listed["sweep-config.schema.json"]
    assert {p.stem for p in (ROOT / "docs").glob("*.md")} <= set(listed)
    assert {f"losses/{p.stem}" for p in (ROOT / "docs" / "losses").glob("*.md")} <= set(listed)

    assert run(["docs", "protocl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: NAME: no document 'protocl'"), err
    assert "did you mean 'protocol'" in err[0]


def test_path_prints_a_file_an_editor_can_open(capsys):
    assert run(["docs", "--path", "sweep-config.schema.json"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.read_bytes() == (ROOT / "docs" / "sweep-config.schema.json").read_bytes()
    assert run(["docs", "--path"]) == 2


def test_the_console_script_prints_a_page():
    exe = Path(sys.executable).with_name("dmlrc")
    r = subprocess.run([str(exe), "docs", "docs/losses/sec.md"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "docs" / "losses" / "sec.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_ships_every_page_dmlrc_docs_lists(tmp_path):
    from tests.test_packaging import _wheel

    names = set(zipfile.ZipFile(_wheel(ROOT, tmp_path)).namelist())
    for name in user_docs():
        rel = "README.md" if name == "readme" else "docs/" + (name if name.endswith(".json") else f"{name}.md")
        assert f"pipelines/user_docs/{rel}" in names, name
    assert not any(n.startswith("pipelines/user_docs/docs/results/") for n in names)
