"""One plugin mechanism for losses and trunks (dml_core/plugins.py): one entry-point lookup, one error family, the
contracts as protocols the signature probes read, and a built-in loss's name written once (by @register)."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest
from torch import nn

import dml_core.losses
import dml_core.plugins as plugins
from dml_core.losses import build_loss, list_losses, loss_info
from dml_core.losses.registry import register
from dml_core.plugins import (
    LossFactory,
    LossPluginError,
    PluginError,
    TrunkFactory,
    TrunkModule,
    TrunkPluginError,
    keyword_parameters,
    lookup_entry_point,
)
from dml_core.trunks import resolve_trunk

LOSSES_DIR = Path(dml_core.losses.__file__).parent


def _entry_points(monkeypatch, group: str, entries: list[tuple[str, str]]) -> None:
    """Installed entry points of ``group`` as importlib.metadata reports them (no distribution behind them)."""
    eps = [importlib.metadata.EntryPoint(name, value, group) for name, value in entries]

    def fake(*, group: str = "") -> list[importlib.metadata.EntryPoint]:
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)


# ------------------------------------------------------------------------------------------------ one error family
def test_loss_and_trunk_plugin_errors_are_one_family():
    assert issubclass(LossPluginError, PluginError) and issubclass(TrunkPluginError, PluginError)
    assert issubclass(PluginError, ValueError)
    assert dml_core.losses.LossPluginError is LossPluginError  # the old import path names the same class


def test_a_broken_trunk_plugin_is_a_plugin_error(monkeypatch):
    _entry_points(
        monkeypatch,
        "dml_reality_check.trunks",
        [("twice", "mod_a:build"), ("twice", "mod_b:build")],
    )
    with pytest.raises(TrunkPluginError, match=r"^trunk 'twice' is exported by two distributions: "):
        resolve_trunk("twice")
    with pytest.raises(TrunkPluginError, match=r"^trunk 'dmlrc_no_such_mod:x': cannot import module"):
        resolve_trunk("dmlrc_no_such_mod:x")


# ------------------------------------------------------------------------------------------------ one lookup
def test_one_lookup_refuses_clashes_and_shadowed_names_in_the_callers_words(monkeypatch):
    _entry_points(monkeypatch, "g", [("one", "a:f"), ("two", "a:f"), ("two", "b:f")])
    kw = dict(error=LossPluginError, clash=lambda eps: f"clash {len(eps)}")
    assert lookup_entry_point("g", "none", **kw) is None
    ep = lookup_entry_point("g", "one", **kw)
    assert ep is not None and ep.value == "a:f"
    with pytest.raises(LossPluginError, match=r"^clash 2$"):
        lookup_entry_point("g", "two", **kw)
    with pytest.raises(LossPluginError, match=r"^built-in one$"):
        lookup_entry_point("g", "one", **kw, shadowed=lambda eps: f"built-in {eps[0].name}")


def test_losses_and_trunks_look_entry_points_up_through_the_shared_lookup(monkeypatch):
    seen: list[tuple[str, str]] = []
    real = plugins.lookup_entry_point

    def spy(group, name, **kw):
        seen.append((group, name))
        return real(group, name, **kw)

    monkeypatch.setattr(plugins, "lookup_entry_point", spy)
    _entry_points(monkeypatch, "dml_reality_check.losses", [])
    with pytest.raises(ValueError, match="unknown loss 'nosuch'"):
        loss_info("nosuch")
    with pytest.raises(ValueError, match="unknown trunk 'nosuch'"):
        resolve_trunk("nosuch")
    assert seen == [("dml_reality_check.losses", "nosuch"), ("dml_reality_check.trunks", "nosuch")]


# ------------------------------------------------------------------------------------------------ contracts in code
def test_the_contracts_are_protocols_the_probes_read():
    assert keyword_parameters(LossFactory) == ("num_classes", "embedding_dim")
    assert keyword_parameters(TrunkFactory) == ("pretrained",)
    assert "feature_dim" in TrunkModule.__annotations__
    for name in list_losses():
        assert isinstance(loss_info(name).factory, LossFactory)
    assert not isinstance(3, LossFactory) and not isinstance("x", TrunkFactory)


def test_a_factory_missing_a_contract_keyword_is_named_in_one_line(monkeypatch, tmp_path):
    (tmp_path / "dmlrc_contract_mod.py").write_text(
        "def f(*, num_classes, margin=0.1):\n    return None\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LossPluginError) as e:
        build_loss("dmlrc_contract_mod:f", num_classes=4, embedding_dim=8)
    assert str(e.value).startswith("loss 'dmlrc_contract_mod:f': dmlrc_contract_mod:f(*, num_classes, margin=0.1)")
    assert "does not take embedding_dim as keyword argument;" in str(e.value)


# ------------------------------------------------------------------------------------------------ name written once
def test_every_builtin_loss_gets_its_name_from_register():
    for name in list_losses():
        assert loss_info(name).factory.name == name


def test_no_registered_loss_class_writes_its_name_itself():
    offenders = []
    files = sorted(LOSSES_DIR.glob("*.py"))
    assert len(files) >= 8, f"found only {files} under {LOSSES_DIR}"
    registered = 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [d for d in node.decorator_list if isinstance(d, ast.Call)]
            if not any(getattr(d.func, "id", None) == "register" for d in decorators):
                continue
            registered += 1
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else []
                if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    targets = [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == "name" for t in targets):
                    offenders.append(f"{path.name}:{stmt.lineno} {node.name}")
    assert registered >= 20
    assert offenders == []


def test_register_refuses_a_class_that_names_itself():
    with pytest.raises(ValueError, match=r"^loss 'dmlrc_test_self_named': Own sets its own name; register\(\) gives"):

        @register("dmlrc_test_self_named", paper="-")
        class Own(nn.Module):
            name = "dmlrc_test_self_named"


# ------------------------------------------------------------------------------------------ one unknown-loss message
def test_an_unknown_loss_is_worded_once_for_the_library_and_the_config():
    from pipelines.config.errors import ConfigError
    from pipelines.config.schema import parse_config

    with pytest.raises(ValueError) as lib:
        build_loss("mpaa", num_classes=4, embedding_dim=8)
    assert type(lib.value).__name__ == "UnknownLossError"
    doc = {"name": "x", "datasets": [{"kind": "synthetic", "num_classes": 4, "per_class": 4}], "losses": ["mpaa"]}
    with pytest.raises(ConfigError) as cfg:
        parse_config(doc)
    assert cfg.value.field == "losses[0].name"
    assert cfg.value.problem.startswith(str(lib.value) + "; did you mean 'mpa'")
    assert str(lib.value).startswith("unknown loss 'mpaa' (known: ") and "sec:<base>" in str(lib.value)
