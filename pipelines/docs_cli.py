"""``dmlrc docs [NAME]``: the user documentation as the installed package has it.

The repository's ``docs/`` (its Markdown pages and the two config JSON Schemas) and ``README.md`` are package data of
``pipelines`` (``pipelines/user_docs/`` holds links to them: one copy, read through ``importlib.resources`` in a
checkout and in an installed wheel alike), so that every help text and message that names a page names one an
installed user can open: ``dmlrc docs protocol`` prints ``docs/protocol.md``.

Names are the paths below ``docs/`` without ``.md`` (``protocol``, ``losses/sec``), the schemas by file name
(``sweep-config.schema.json``) and ``readme``; :func:`resolve_doc` also takes the spellings messages use
(``docs/protocol.md``, ``protocol.md``).
"""

from __future__ import annotations

import json
import re
import sys
from importlib import resources
from typing import TYPE_CHECKING

from pipelines.config.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # annotations only: importlib.resources.abc is Python 3.11+, importlib.abc's copy 3.10's
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["add_docs_parser", "user_docs", "resolve_doc", "doc_title", "DOC_MENTION"]

#: The package-data folder (links to the repository's ``docs/`` and ``README.md``).
DOCS_FOLDER = "user_docs"
README = "readme"
#: A mention of a shipped page in a message or help text: ``docs/<path>.md`` or ``docs/<name>.schema.json``.
DOC_MENTION = re.compile(r"\bdocs/[A-Za-z0-9_./-]+?\.(?:md|schema\.json)\b")


def _walk(folder: Traversable, prefix: str = ""):
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            yield from _walk(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".md"):
            yield f"{prefix}{entry.name[: -len('.md')]}", entry
        elif entry.name.endswith(".schema.json"):
            yield f"{prefix}{entry.name}", entry


def user_docs() -> dict[str, Traversable]:
    """Every shipped page by name: ``readme``, then ``docs/``'s pages (``protocol``, ``losses/sec``, ...) and schemas
    (``sweep-config.schema.json``).  The results folder (``docs/results``: a report with its images) and images are
    not pages of their own and are not shipped."""
    root = resources.files("pipelines").joinpath(DOCS_FOLDER)
    out: dict[str, Traversable] = {}
    readme = root.joinpath("README.md")
    if readme.is_file():
        out[README] = readme
    docs = root.joinpath("docs")
    if docs.is_dir():
        pages = {name: entry for name, entry in _walk(docs) if not name.startswith(("results/", "img/"))}
        out.update(sorted(pages.items()))
    return out


def resolve_doc(ref: str) -> str:
    """The name of the page ``ref`` means: a name (``protocol``), a file name (``protocol.md``) or a repository path
    (``docs/protocol.md``, ``README.md``); a :class:`ConfigError` naming ``NAME`` otherwise."""
    known = user_docs()
    text = ref.strip()
    name = text.removeprefix("./").removeprefix("docs/")
    if name.endswith(".md"):
        name = name[: -len(".md")]
    if name.lower() == README:  # README.md, README, readme
        name = README
    if name in known:
        return name
    raise ConfigError("NAME", f"no document {ref!r} (the pages: {', '.join(known)}){did_you_mean(name, known)}")


def doc_title(name: str, entry: Traversable) -> str:
    """A page's first heading (a schema's ``title``)."""
    text = entry.read_text(encoding="utf-8")
    if name.endswith(".json"):
        try:
            return f"JSON Schema: {json.loads(text).get('title', name)}"
        except ValueError:
            return "JSON Schema"
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def add_docs_parser(sub) -> None:
    p = sub.add_parser(
        "docs",
        help="list the user documentation shipped with the package, or print one page (dmlrc docs protocol)",
        description="The documentation pages that help texts and messages refer to, as installed with the "
        "package: dmlrc docs NAME prints one; without a NAME, the pages are listed.",
    )
    p.add_argument("name", nargs="?", default=None, metavar="NAME", help="page to print (none: list them)")
    p.add_argument(
        "--path",
        action="store_true",
        help="print the page's file path instead of its text (e.g. for an editor's yaml-language-server $schema=)",
    )
    p.set_defaults(func=_run_docs)


def _run_docs(args) -> int:
    known = user_docs()
    if args.name is None:
        if args.path:
            raise ConfigError("--path", "needs a NAME, e.g. dmlrc docs --path sweep-config.schema.json")
        width = max(len(n) for n in known)
        print("documentation shipped with dmlrc (dmlrc docs NAME prints one):")
        for name, entry in known.items():
            print(f"  {name:{width}s}  {doc_title(name, entry)}")
        return 0
    name = resolve_doc(args.name)
    entry = known[name]
    if args.path:
        with resources.as_file(entry) as path:  # installed packages are plain folders: the path stays valid
            print(path)
        return 0
    text = entry.read_text(encoding="utf-8")
    print(text, end="" if text.endswith("\n") else "\n")
    return 0
