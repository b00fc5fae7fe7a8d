"""``dmlrc list [--json]``: what a sweep config can name, read from the registries; installed plug-ins with the
distribution behind each.

The plug-ins are real installed distributions: ``<name>-<version>.dist-info`` folders on ``sys.path`` (under
``tmp_path``) that ``importlib.metadata`` finds like any installed one, with entry points of both groups.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dml_core.losses import list_losses, list_wrappers, loss_info
from dml_core.losses.registry import ENTRY_POINT_GROUP as LOSS_GROUP
from dml_core.trunks import list_trunks
from dml_core.trunks.plugins import ENTRY_POINT_GROUP as TRUNK_GROUP
from pipelines.commands import run
from pipelines.config.fields import DATASET_KINDS
from pipelines.config.presets import presets
from pipelines.listing import catalogue, render_text


def _no_nan(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in --json output"))


def _rows(text: str, section: str) -> list[list[str]]:
    """The table rows (split on two or more spaces) of one section of the text output."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    while lines[start].startswith(section) or not lines[start].startswith("  "):
        start += 1  # the heading may wrap
    rows = []
    for line in lines[start + 1 :]:  # after the column headers
        if not line.startswith("  "):
            break
        cells = [c for c in line.strip().split("  ") if c.strip()]
        if not line.startswith("   "):  # a continuation line of a wrapped last column starts further in
            rows.append([c.strip() for c in cells])
    return rows


def test_the_text_lists_every_built_in_loss_with_its_family_and_paper(capsys):
    assert run(["list"]) == 0
    text = capsys.readouterr().out
    rows = {r[0]: r for r in _rows(text, "Losses")}
    assert sorted(rows) == list_losses()
    for name, row in rows.items():
        info = loss_info(name)
        family = info.factory.__module__.rsplit(".", 1)[-1]
        assert row[1] == family, row
        assert info.paper.split(";")[0].startswith(row[3]), (row, info.paper)  # the first line of the citation
    wrappers = {r[0] for r in _rows(text, "Wrappers")}
    assert wrappers == set(list_wrappers())
    trunks = {r[0] for r in _rows(text, "Trunks")}
    assert set(list_trunks()) | {"timm:<model>", "package.module:attr"} == trunks
    assert {r[0] for r in _rows(text, "Dataset kinds")} == set(DATASET_KINDS)
    assert {r[0] for r in _rows(text, "Presets")} == set(presets())
    assert "none installed" in text.split("Installed plug-ins")[1]


def test_json_parses_and_holds_what_the_registries_say(capsys):
    assert run(["list", "--json"]) == 0
    doc = _no_nan(capsys.readouterr().out)
    assert [loss["name"] for loss in doc["losses"]] == list_losses()
    for loss in doc["losses"]:
        info = loss_info(loss["name"])
        assert loss["paper"] == info.paper and loss["learnable"] == info.learnable
        assert loss["family"] == info.factory.__module__.rsplit(".", 1)[-1]
    assert [w["name"] for w in doc["wrappers"]] == list_wrappers()
    assert "sec:triplet" in next(w for w in doc["wrappers"] if w["name"] == "sec")["search_spaces"]
    assert [t["name"] for t in doc["trunks"]] == list(list_trunks())
    assert sorted(d["kind"] for d in doc["dataset_kinds"]) == sorted(DATASET_KINDS)
    assert "cub200" in doc["prepare_datasets"] and "csv" in doc["prepare_datasets"]
    assert [p["name"] for p in doc["presets"]] == list(presets())
    assert doc == json.loads(json.dumps(catalogue()))  # the command prints the catalogue as it is


def test_the_console_script_prints_json():
    exe = Path(sys.executable).with_name("dmlrc")
    r = subprocess.run([str(exe), "list", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [loss["name"] for loss in _no_nan(r.stdout)["losses"]] == list_losses()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory on ``sys.path`` holding installed-distribution metadata."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()

    def dist(name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, eps in groups.items():
            lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in eps.items()] + [""]
        (info / "entry_points.txt").write_text("\n".join(lines))
        (info / "RECORD").write_text("")
        importlib.invalidate_caches()

    yield dist
    importlib.invalidate_caches()


def test_an_installed_plugin_is_listed_with_its_distribution(site, capsys):
    site("acme-losses", "1.2.3", {LOSS_GROUP: {"circle": "acme.losses:Circle"}, TRUNK_GROUP: {"wide": "acme.t:wide"}})
    site("other-dist", "0.1", {LOSS_GROUP: {"contrastive": "other.losses:Mine"}})  # a built-in's name

    assert run(["list", "--json"]) == 0
    plugins = {(p["kind"], p["name"]): p for p in _no_nan(capsys.readouterr().out)["plugins"]}
    circle = plugins[("loss", "circle")]
    assert circle["distributions"] == [{"name": "acme-losses", "version": "1.2.3", "origin": "index"}]
    assert circle["status"] == "ok"
    assert plugins[("trunk", "wide")]["distributions"][0]["name"] == "acme-losses"
    shadowed = plugins[("loss", "contrastive")]
    assert shadowed["distributions"][0]["name"] == "other-dist" and shadowed["status"].startswith("refused")
    assert "acme" not in sys.modules  # listed from metadata: no plugin code imported

    text = render_text(catalogue(), width=120)
    rows = {(r[0], r[1]): r for r in _rows(text, "Installed plug-ins")}
    assert rows[("loss", "circle")][2:] == ["acme-losses 1.2.3", "ok"]
    assert rows[("trunk", "wide")][2:] == ["acme-losses 1.2.3", "ok"]
    assert rows[("loss", "contrastive")][2] == "other-dist 0.1"
    # the built-in tables stay the built-ins': the plug-ins are their own section
    assert "circle" not in {r[0] for r in _rows(text, "Losses")}
    assert "wide" not in {r[0] for r in _rows(text, "Trunks")}
