"""The config side of a user's own code (docs/plugins.md): inline search spaces that override one loss's space and
leave the others alone, ``losses: all``, the ``runtime_env`` section and how it reaches Ray and the driver."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from pipelines.config import ConfigError, parse_config
from pipelines.config.presets import DEMO
from pipelines.config.spaces import builtin_spaces

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin" / "src" / "dmlrc_example"


def _doc(**top):
    doc = copy.deepcopy(DEMO)
    doc.update(top)
    return doc


def test_an_inline_space_overrides_one_loss_and_leaves_the_others_their_own():
    inline = {
        "space": {"pos_margin": {"low": 0.0, "high": 0.2}},
        "fixed": {"neg_margin": 1.5},
        "paper_defaults": {"pos_margin": 0.1},
    }
    cfg = parse_config(_doc(losses=[{"name": "contrastive", "space": inline}, "mpa", "proxynca_pp"]))
    spaces = {ls.name: ls.search_space for ls in cfg.losses}
    assert spaces["contrastive"].params["pos_margin"].high == 0.2 and spaces["contrastive"].fixed == {"neg_margin": 1.5}
    assert "neg_margin" not in cfg.losses[0].searched()
    builtin = builtin_spaces()
    assert spaces["mpa"] == builtin["mpa"] and spaces["proxynca_pp"] == builtin["proxynca_pp"]
    assert builtin["contrastive"].params["pos_margin"].high != 0.2  # the built-in space is untouched
    # a pinned value is checked against the inline space, not the built-in one
    with pytest.raises(ConfigError) as e:
        parse_config(_doc(losses=[{"name": "contrastive", "space": inline, "params": {"pos_margin": 0.5}}]))
    assert e.value.field == "losses[0].params.pos_margin"


def test_a_space_file_named_by_the_config(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("space:\n  pos_margin: {low: 0.0, high: 0.3}\npaper_defaults:\n  pos_margin: 0.0\n")
    cfg = parse_config(_doc(losses=[{"name": "contrastive", "space": str(f)}]))
    assert cfg.losses[0].search_space.params["pos_margin"].high == 0.3


def test_a_user_folder_adds_to_and_overrides_the_builtin_spaces(tmp_path):
    (tmp_path / "contrastive.yaml").write_text(
        "loss: contrastive\nspace:\n  pos_margin: {low: 0.0, high: 0.4}\npaper_defaults:\n  pos_margin: 0.0\n"
    )
    cfg = parse_config(_doc(tune_spaces=str(tmp_path), losses=["contrastive", "mpa"]))
    assert cfg.losses[0].search_space.params["pos_margin"].high == 0.4
    assert cfg.losses[1].search_space == builtin_spaces()["mpa"]  # no file for mpa in the folder: the built-in one


def test_losses_all_is_every_builtin_loss_with_a_space_minus_exclude():
    cfg = parse_config(_doc(losses="all"))
    assert [ls.name for ls in cfg.losses] == sorted(builtin_spaces())
    cfg = parse_config(_doc(losses={"all": True, "exclude": ["group_loss", "rsw"]}))
    names = [ls.name for ls in cfg.losses]
    assert "group_loss" not in names and "rsw" not in names and len(names) == len(builtin_spaces()) - 2


def test_an_import_path_loss_with_a_shipped_space_and_runtime_env_py_modules():
    doc = _doc(
        losses=["contrastive", "dmlrc_example.losses:CircleLoss"],
        runtime_env={"py_modules": [str(PLUGIN)], "env_vars": {"MYLAB_MODE": "fast"}},
    )
    try:
        cfg = parse_config(doc)
        assert str(PLUGIN.parent) in sys.path  # the driver imports what the workers get
        space = cfg.losses[1].search_space
        assert set(space.params) == {"m", "gamma"} and space.paper_defaults == {"m": 0.4, "gamma": 80.0}
        assert cfg.runtime_env.ray_runtime_env() == {"py_modules": [str(PLUGIN)], "env_vars": {"MYLAB_MODE": "fast"}}
        assert cfg.model_dump(mode="json")["runtime_env"]["py_modules"] == [str(PLUGIN)]
    finally:
        if str(PLUGIN.parent) in sys.path:
            sys.path.remove(str(PLUGIN.parent))
        for m in [m for m in sys.modules if m.startswith("dmlrc_example")]:
            del sys.modules[m]


def test_init_ray_puts_the_users_runtime_env_under_the_jobs(monkeypatch):
    """Every Ray process inherits the job's runtime_env: the user's py_modules / pip / env_vars next to ours."""
    import ray

    from pipelines.execution.runtime import session as ray_session

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    try:
        ray_session.init_ray(
            None,
            num_cpus=2,
            user_env={"py_modules": ["/x/mylab"], "pip": ["mylab==1.0"], "env_vars": {"MYLAB_MODE": "fast"}},
        )
    finally:
        ray_session.stop_ray(False)
    env = seen["runtime_env"]
    assert env["py_modules"] == ["/x/mylab"] and env["pip"] == ["mylab==1.0"]
    assert env["env_vars"]["MYLAB_MODE"] == "fast" and "AWS_SECRET_ACCESS_KEY" not in env["env_vars"]
