"""Losses from outside dml_core (docs/plugins.md, "Losses"): import paths, entry points, loss_metadata, shipped
search spaces, wrappers around plugins, the protocol constants' home, and every one-line plugin error.

Plugins are real modules and real installed distributions: modules written under ``tmp_path`` on ``sys.path`` and
``<name>-<version>.dist-info`` folders next to them, which ``importlib.metadata`` finds like any installed one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import dml_core.losses.registry as registry
import dml_core.protocol as protocol
import dml_core.training.loop as train_mod
from dml_core.data import ImageDataset, synthetic
from dml_core.losses import (
    ENTRY_POINT_GROUP,
    MLRC_BATCH,
    MLRC_MODEL,
    BatchSpec,
    LossPluginError,
    ModelRecipe,
    PluginDistribution,
    build_loss,
    check_plugin_losses,
    list_losses,
    list_plugin_losses,
    loss_info,
    loss_metadata,
    plugin_space,
    registered_info,
    resolve_loss,
)
from dml_core.losses.sec import L2NormRegularizer, SphericalEmbeddingConstraint
from dml_core.models import EmbeddingModel
from dml_core.training.loop import TrainConfig, _optimizer, loss_weight_decay_for, train_fold

ROOT = Path(__file__).resolve().parents[2]
KW = {"num_classes": 4, "embedding_dim": 8}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# A plugin module: the loss kinds a lab would write.  Line numbers matter for nothing here.
LABMOD = '''
import torch
import torch.nn.functional as F
from torch import nn

from dml_core.losses import BatchSpec, ModelRecipe, loss_metadata


class PlainProxy(nn.Module):
    """One learnable proxy per class, no metadata at all."""

    def __init__(self, *, num_classes, embedding_dim, scale=3.0):
        super().__init__()
        self.proxies = nn.Parameter(torch.randn(num_classes, embedding_dim))
        self.scale = scale

    def forward(self, embeddings, labels):
        d2 = torch.cdist(F.normalize(embeddings, dim=1), F.normalize(self.proxies, dim=1)).pow(2)
        return F.cross_entropy(-self.scale * d2, labels)


class Pair(nn.Module):
    def __init__(self, margin):
        super().__init__()
        self.margin = margin

    def forward(self, embeddings, labels):
        z = F.normalize(embeddings, dim=1)
        d2 = (2 - 2 * z @ z.T).clamp_min(0)
        same = labels[:, None] == labels[None, :]
        return d2[same].mean() + F.relu(self.margin - d2[~same]).mean()


def pair_loss(*, num_classes, embedding_dim, margin=0.5):
    """A factory function without parameters."""
    return Pair(margin)


@loss_metadata(
    paper="Sun et al., Circle Loss, CVPR 2020",
    learnable=False,
    batch=BatchSpec(classes_per_batch=4, m=2),
    model=ModelRecipe(pooling="max", layer_norm=True),
    loss_weight_decay=0.0,
    description="a pair loss",
    space={"space": {"margin": {"low": 0.1, "high": 1.0}}, "fixed": {}, "paper_defaults": {"margin": 0.25}},
)
class Circle(Pair):
    def __init__(self, *, num_classes, embedding_dim, margin=0.25):
        super().__init__(margin)


class CircleChild(Circle):
    """Inherits the class, not the metadata."""


@loss_metadata(space="labmod_spaces:spaces/proxy.yaml")
class ShippedProxy(PlainProxy):
    pass


@loss_metadata(learnable=True, own_optimizer=False)
def declared(*, num_classes, embedding_dim):
    return PlainProxy(num_classes=num_classes, embedding_dim=embedding_dim)


def needs_margin(*, num_classes, embedding_dim, margin):
    return Pair(margin)


def no_sizes(margin=0.5):
    return Pair(margin)


def positional_only(num_classes, embedding_dim, /):
    return Pair(0.5)


class NoArgs(nn.Module):
    def forward(self, embeddings, labels):
        return embeddings.sum()


def not_a_module(*, num_classes, embedding_dim):
    return lambda embeddings, labels: embeddings.sum()


CONSTANT = 3
'''


class Lab:
    """A site directory on ``sys.path`` holding plugin modules and installed-distribution metadata."""

    def __init__(self, root: Path):
        self.root = root

    def module(self, rel: str, source: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"), encoding="utf-8")
        importlib.invalidate_caches()
        return path

    def dist(self, name: str, version: str, entry_points: dict[str, str], files: tuple[str, ...] = ()) -> None:
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        importlib.invalidate_caches()


@pytest.fixture
def lab(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield Lab(root)
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(root)):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def labmod(lab):
    lab.module("labmod.py", LABMOD)
    return lab


def _batch(dim: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, dim, generator=g), torch.arange(8) % 4


def _one_line_error(name: str, **params) -> str:
    with pytest.raises(LossPluginError) as e:
        build_loss(name, **{**KW, **params})
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ------------------------------------------------------------------------------------------------ protocol constants
def test_protocol_constants_have_one_home_and_keep_their_old_names():
    import dml_core.losses as losses

    for name in ("MLRC_PAPER", "MLRC_BATCH", "MLRC_MODEL", "MLRC_LOSS_WEIGHT_DECAY", "BatchSpec", "ModelRecipe"):
        assert getattr(registry, name) is getattr(protocol, name) is getattr(losses, name)
    assert train_mod.MLRC_LOSS_WEIGHT_DECAY is protocol.MLRC_LOSS_WEIGHT_DECAY == 1e-4
    assert registry.LossInfo("x", dict, "p").loss_weight_decay == protocol.MLRC_LOSS_WEIGHT_DECAY

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "dml_core.training.loop" not in imports(ROOT / "dml_core" / "losses" / "registry.py")
    assert imports(ROOT / "dml_core" / "protocol.py") <= {"__future__", "dataclasses"}


def test_train_imports_without_the_loss_zoo():
    """dml_core.training.loop takes its constant from dml_core.protocol; the registry (and with it the loss zoo) is
    imported only when a loss built by build_loss is trained."""
    code = (
        "import sys\nimport dml_core.training.loop as t\nprint('dml_core.losses' in sys.modules)\n"
        "import dml_core.losses.registry as r\nprint(r.MLRC_LOSS_WEIGHT_DECAY is t.MLRC_LOSS_WEIGHT_DECAY)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


# ------------------------------------------------------------------------------------------------ import paths
def test_import_path_loss_without_metadata_gets_the_safe_defaults(labmod):
    info = resolve_loss("labmod:PlainProxy")
    assert (info.origin, info.distribution, info.name) == ("import_path", None, "labmod:PlainProxy")
    assert info.paper == "labmod:PlainProxy" and info.description == ""
    assert info.batch is MLRC_BATCH and info.model is MLRC_MODEL
    assert info.loss_weight_decay == protocol.MLRC_LOSS_WEIGHT_DECAY
    assert info.learnable is None and info.own_optimizer is None  # decided on the built module
    assert loss_info("labmod:PlainProxy").factory is info.factory is sys.modules["labmod"].PlainProxy

    loss = build_loss("labmod:PlainProxy", **KW, scale=2.0)
    assert type(loss).__name__ == "PlainProxy" and loss.scale == 2.0 and loss.proxies.shape == (4, 8)
    assert loss.registry_name == "labmod:PlainProxy"
    built = registered_info(loss)
    assert built.learnable is True and built.own_optimizer is True and built.origin == "import_path"
    x, y = _batch()
    assert torch.isfinite(loss(x, y))

    pair = build_loss("labmod:pair_loss", **KW, margin=0.3)
    assert pair.margin == 0.3 and registered_info(pair).learnable is False
    assert registered_info(pair).own_optimizer is False
    assert "labmod:PlainProxy" not in list_losses()  # resolving registers nothing


def test_import_path_loss_with_metadata(labmod):
    before = dict(registry._REGISTRY)
    info = resolve_loss("labmod:Circle")
    assert info.paper == "Sun et al., Circle Loss, CVPR 2020" and info.description == "a pair loss"
    assert info.learnable is False and info.own_optimizer is False
    assert info.batch == BatchSpec(classes_per_batch=4, m=2) and info.model == ModelRecipe("max", True)
    assert info.loss_weight_decay == 0.0
    loss = build_loss("labmod:Circle", **KW)
    assert registered_info(loss).loss_weight_decay == 0.0
    assert loss_weight_decay_for(loss, TrainConfig()) == 0.0  # train_fold reads the plugin's own value
    assert registry._REGISTRY == before, "loss_metadata must not register anything"

    declared = resolve_loss("labmod:declared")
    assert declared.learnable is True and declared.own_optimizer is False
    child = resolve_loss("labmod:CircleChild")  # metadata belongs to the decorated object only
    assert child.learnable is None and child.paper == "labmod:CircleChild" and child.batch is MLRC_BATCH

    assert loss_metadata(paper="p")(sys.modules["labmod"].no_sizes) is sys.modules["labmod"].no_sizes


def test_a_rebuilt_plugin_loss_resolves_the_same_way(labmod):
    loss = build_loss("sec:labmod:PlainProxy", **KW)
    again = build_loss(loss.registry_name, **KW)
    assert type(again) is type(loss) and type(again.base) is type(loss.base)
    assert registered_info(again) == registered_info(loss)


def test_a_learnable_plugin_loss_trains_its_parameters(labmod):
    table = synthetic(12, 6, image_size=16, seed=0)
    classes = np.unique(table.labels)
    train, val = ImageDataset(table.subset(classes[:8])), ImageDataset(table.subset(classes[8:]))
    torch.manual_seed(0)
    model = EmbeddingModel(trunk="tiny", embedding_dim=8)
    loss = build_loss("labmod:PlainProxy", num_classes=8, embedding_dim=8)
    cfg = TrainConfig(
        classes_per_batch=4,
        m=2,
        iters_per_epoch=2,
        max_epochs=2,
        eval_every=1,
        patience=None,
        eval_batch_size=16,
        seed=0,
        device="cpu",
        loss_lr=0.05,
    )
    groups = {g["name"]: g for g in _optimizer(model, loss, cfg).param_groups}
    assert [p is loss.proxies for p in groups["loss"]["params"]] == [True]
    assert groups["loss"]["lr"] == 0.05 and groups["loss"]["weight_decay"] == protocol.MLRC_LOSS_WEIGHT_DECAY

    before = loss.proxies.detach().clone()
    res = train_fold(model, loss, train, val, cfg)
    assert res.status == "ok"
    assert not torch.equal(before, loss.proxies.detach()), "the plugin's proxies were not optimised"
    assert set(res.best_state["loss"]) == {"proxies"}  # checkpointed with the model

    images = torch.stack([train[i][0] for i in range(8)])
    labels = torch.as_tensor(np.unique(train.labels, return_inverse=True)[1][:8])
    loss.zero_grad()
    loss(model(images), labels).backward()
    assert loss.proxies.grad is not None and loss.proxies.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ wrappers
def test_wrappers_around_plugin_losses(labmod):
    lab = labmod
    lab.dist("lab-plugins", "0.1", {"circle": "labmod:Circle"}, files=("labmod.py",))
    x, y = _batch()

    sec = build_loss("sec:labmod:PlainProxy", **KW, sec_eta=0.5, scale=2.0)
    assert isinstance(sec, SphericalEmbeddingConstraint) and sec.eta == 0.5 and sec.base.scale == 2.0
    assert sec.registry_name == "sec:labmod:PlainProxy"
    assert loss_info("sec:labmod:PlainProxy").name == "labmod:PlainProxy"
    assert registered_info(sec).learnable is True  # the base's proxies, through the wrapper
    assert torch.isfinite(sec(x, y))

    l2 = build_loss("l2_reg:circle", **KW, l2_reg_eta=1e-3, margin=0.3)
    assert isinstance(l2, L2NormRegularizer) and l2.eta == 1e-3 and l2.base.margin == 0.3
    assert registered_info(l2).origin == "entry_point" and registered_info(l2).loss_weight_decay == 0.0
    assert torch.isfinite(l2(x, y))

    both = build_loss("sec:l2_reg:circle", **KW)
    assert isinstance(both, SphericalEmbeddingConstraint) and isinstance(both.base, L2NormRegularizer)
    by_param = build_loss("labmod:Circle", **KW, sec_eta=0.25)
    assert isinstance(by_param, SphericalEmbeddingConstraint) and by_param.registry_name == "labmod:Circle"
    with pytest.raises(ValueError, match=r"^loss 'sec:Circle': sec_eta must be a finite number >= 0, got -1.0$"):
        build_loss("labmod:Circle", **KW, sec_eta=-1.0)  # the wrapper's own check, naming the plugin's class
    with pytest.raises(ValueError, match=r"^loss 'sec:sec:triplet': wrapper 'sec' is applied twice$"):
        build_loss("sec:sec:triplet", **KW)


# ------------------------------------------------------------------------------------------------ entry points
def test_entry_point_loss(labmod, monkeypatch):
    lab = labmod
    lab.dist("lab-plugins", "0.1", {"circle": "labmod:Circle", "proxy": "labmod:PlainProxy"}, files=("labmod.py",))
    sys.modules.pop("labmod", None)

    assert list_plugin_losses() == {
        "circle": (PluginDistribution("lab-plugins", "0.1"),),
        "proxy": (PluginDistribution("lab-plugins", "0.1"),),
    }
    assert "labmod" not in sys.modules, "listing must not import plugin modules"
    assert "circle" not in list_losses()
    check_plugin_losses()  # nothing ambiguous

    info = resolve_loss("circle")
    assert (info.name, info.origin) == ("circle", "entry_point")
    assert info.distribution == PluginDistribution("lab-plugins", "0.1")
    assert info.distribution.requirement == "lab-plugins==0.1" and str(info.distribution) == "lab-plugins 0.1"
    assert info.factory is sys.modules["labmod"].Circle and info.loss_weight_decay == 0.0
    loss = build_loss("proxy", **KW)
    assert loss.registry_name == "proxy" and registered_info(loss).learnable is True

    # The same module by its import path: its distribution comes from the installed file list.
    assert resolve_loss("labmod:Circle").distribution == PluginDistribution("lab-plugins", "0.1")
    assert resolve_loss("labmod:Circle").origin == "import_path"

    # Built-in names never reach the entry points (looked up only for names that are not built in).
    def no_scan(**kw):
        raise AssertionError("entry points scanned for a built-in name")

    monkeypatch.setattr(importlib.metadata, "entry_points", no_scan)
    assert resolve_loss("triplet").origin == "builtin" and resolve_loss("sec:triplet").distribution is None
    build_loss("proxynca", **KW)


def test_an_entry_point_exported_by_two_distributions_is_refused(labmod):
    lab = labmod
    lab.dist("alpha-losses", "0.1", {"circle": "labmod:Circle"})
    lab.dist("beta-losses", "0.2", {"circle": "labmod:PlainProxy"})
    assert set(list_plugin_losses()["circle"]) == {
        PluginDistribution("alpha-losses", "0.1"),
        PluginDistribution("beta-losses", "0.2"),
    }
    for call in (lambda: resolve_loss("circle"), lambda: build_loss("sec:circle", **KW), check_plugin_losses):
        with pytest.raises(LossPluginError) as e:
            call()
        message = str(e.value)
        assert message.startswith(
            "loss 'circle': entry point of group 'dml_reality_check.losses' exported by more than one distribution: "
        )
        assert "alpha-losses 0.1 ('labmod:Circle')" in message and "beta-losses 0.2 ('labmod:PlainProxy')" in message
        assert message.endswith("uninstall one, or name the loss by its import path")


def test_an_entry_point_named_like_a_built_in_is_reported(labmod):
    labmod.dist("lab-plugins", "0.1", {"triplet": "labmod:Circle"})
    assert resolve_loss("triplet").origin == "builtin"  # the built-in always wins
    with pytest.raises(
        LossPluginError,
        match=r"^loss 'triplet': entry point of lab-plugins 0\.1 \('labmod:Circle', "
        r"group 'dml_reality_check\.losses'\) has the name of a built-in loss of \S+, which always "
        r"wins; rename the entry point or name the plugin's loss by its import path$",
    ):
        check_plugin_losses()


def test_entry_point_errors_name_the_distribution(lab):
    lab.module("labbroken.py", "import torch\nraise ImportError('needs CUDA 13')\n")
    lab.dist("lab-broken", "0.3", {"broken": "labbroken:Loss", "bare": "labbroken"})
    with pytest.raises(LossPluginError) as e:
        resolve_loss("broken")
    assert str(e.value) == (
        f"loss 'broken' (entry point 'labbroken:Loss' of lab-broken 0.3): cannot import module "
        f"'labbroken': ImportError: needs CUDA 13 ({lab.root / 'labbroken.py'}:2)"
    )
    with pytest.raises(
        LossPluginError,
        match=r"^loss 'bare' \(entry point 'labbroken' of lab-broken 0\.3\): names a "
        r"module, not a loss factory; the value must be 'module:attribute'$",
    ):
        resolve_loss("bare")


def test_an_unknown_name_lists_builtins_and_plugins(labmod):
    labmod.dist("lab-plugins", "0.1", {"circle": "labmod:Circle"})
    with pytest.raises(ValueError) as e:
        resolve_loss("nosuch")
    assert not isinstance(e.value, LossPluginError)
    assert str(e.value).startswith("unknown loss 'nosuch' (known: ")
    assert str(e.value).endswith("; plugins: circle; or an import path 'package.module:attribute')")
    assert "triplet" in str(e.value)


# ------------------------------------------------------------------------------------------------ shipped spaces
def test_shipped_space_as_a_mapping(labmod):
    space = plugin_space("labmod:Circle")
    assert space == {"space": {"margin": {"low": 0.1, "high": 1.0}}, "fixed": {}, "paper_defaults": {"margin": 0.25}}
    space["space"]["margin"]["low"] = 99  # a copy: the plugin's declaration is not the caller's to change
    assert plugin_space("sec:labmod:Circle")["space"]["margin"]["low"] == 0.1  # wrapped: the base's space
    assert plugin_space("labmod:PlainProxy") is None  # no metadata
    assert plugin_space("labmod:CircleChild") is None
    assert plugin_space("proxynca") is None  # built-ins: tune_spaces/*.yaml


def test_shipped_space_as_a_package_resource(labmod):
    lab = labmod
    lab.module("labmod_spaces/__init__.py", "")
    lab.module(
        "labmod_spaces/spaces/proxy.yaml",
        """
        # a plugin's own space file
        loss: labmod:ShippedProxy
        space:
          scale: {low: 1.0, high: 30.0, log: true}
          loss_lr: {low: 1.0e-6, high: 1.0, log: true}
        paper_defaults:
          scale: 9.0
    """,
    )
    assert plugin_space("labmod:ShippedProxy") == {
        "loss": "labmod:ShippedProxy",
        "space": {"scale": {"low": 1.0, "high": 30.0, "log": True}, "loss_lr": {"low": 1e-6, "high": 1.0, "log": True}},
        "paper_defaults": {"scale": 9.0},
    }


@pytest.mark.parametrize(
    "content,message",
    [
        (None, r"package 'labmod_spaces' has no file 'spaces/proxy\.yaml'$"),
        ("space: [unclosed\n", r"not valid YAML at line 2: expected ',' or '\]', but got '<stream end>'$"),
        ("- a list\n", r"expected a mapping with keys loss, space, fixed, paper_defaults, got list$"),
    ],
)
def test_shipped_space_errors(labmod, content, message):
    lab = labmod
    lab.module("labmod_spaces/__init__.py", "")
    if content is not None:
        lab.module("labmod_spaces/spaces/proxy.yaml", content)
    with pytest.raises(
        LossPluginError,
        match=r"^loss 'labmod:ShippedProxy': search space "
        r"'labmod_spaces:spaces/proxy\.yaml': " + message,
    ):
        plugin_space("labmod:ShippedProxy")


def test_shipped_space_in_a_package_that_does_not_import(labmod):
    with pytest.raises(
        LossPluginError,
        match=r"^loss 'labmod:ShippedProxy': search space 'labmod_spaces:spaces/"
        r"proxy\.yaml': cannot read it: ModuleNotFoundError: No module named 'labmod_spaces'$",
    ):
        plugin_space("labmod:ShippedProxy")


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"space": "labmod_spaces/spaces/proxy.yaml"}, ValueError, "is not 'package:relative/file.yaml'"),
        ({"space": "labmod_spaces:../secrets.yaml"}, ValueError, "is not 'package:relative/file.yaml'"),
        ({"space": "labmod_spaces:/etc/space.yaml"}, ValueError, "is not 'package:relative/file.yaml'"),
        ({"space": 3}, TypeError, "space must be a mapping or 'package:relative/file.yaml', got int"),
        ({"learnable": "yes"}, TypeError, "learnable must be true, false or None, got 'yes'"),
        ({"batch": (8, 4)}, TypeError, "batch must be a dml_core.losses.BatchSpec, got tuple"),
        ({"model": "avg"}, TypeError, "model must be a dml_core.losses.ModelRecipe, got str"),
        ({"loss_weight_decay": -1}, ValueError, "loss_weight_decay must be a finite number >= 0, got -1"),
        ({"paper": None}, TypeError, "paper must be a string, got NoneType"),
    ],
)
def test_loss_metadata_rejects_bad_declarations(kwargs, error, message):
    with pytest.raises(error, match="^loss_metadata: .*" + message.replace(".", r"\.").replace("(", r"\(")):
        loss_metadata(**kwargs)


# ------------------------------------------------------------------------------------------------ one-line errors
def test_a_module_that_raises_on_import_shows_the_plugins_exception_and_line(lab):
    path = lab.module("labraise.py", "import math\n\nvalue = math.sqrt(-1)\n")
    assert _one_line_error("labraise:Loss") == (
        f"loss 'labraise:Loss': cannot import module 'labraise': ValueError: math domain error ({path}:3)"
    )


def test_a_plugin_with_a_missing_dependency_shows_its_import_line(lab):
    path = lab.module("labdep.py", "import torch\nimport not_installed_dep_for_dmlrc_tests\n")
    assert _one_line_error("labdep:Loss") == (
        f"loss 'labdep:Loss': cannot import module 'labdep': ModuleNotFoundError: No module named "
        f"'not_installed_dep_for_dmlrc_tests' ({path}:2)"
    )


def test_a_plugin_with_a_syntax_error(lab):
    path = lab.module("labsyntax.py", "x = 1\ndef broken(:\n")
    message = _one_line_error("labsyntax:Loss")
    assert message.startswith("loss 'labsyntax:Loss': cannot import module 'labsyntax': SyntaxError: ")
    assert message.endswith(f"({path}:2)")


def test_a_bad_loss_metadata_in_a_plugin_points_at_the_plugins_line(lab):
    path = lab.module(
        "labmeta.py",
        """
        from dml_core.losses import loss_metadata

        @loss_metadata(learnable="yes")
        def loss(*, num_classes, embedding_dim):
            pass
    """,
    )
    assert _one_line_error("labmeta:loss") == (
        "loss 'labmeta:loss': cannot import module 'labmeta': TypeError: loss_metadata: learnable must be true, "
        f"false or None, got 'yes' ({path}:3)"
    )


def test_a_module_that_is_not_there(lab):
    assert _one_line_error("labmissing_xyz:Loss") == (
        "loss 'labmissing_xyz:Loss': cannot import module 'labmissing_xyz' (ModuleNotFoundError: No module named "
        "'labmissing_xyz'): not installed or not on sys.path, and 'labmissing_xyz' is not a loss wrapper (l2_reg, sec)"
    )
    assert _one_line_error("sec:labmissing_xyz.sub:Loss") == (
        "loss 'sec:labmissing_xyz.sub:Loss': cannot import module 'labmissing_xyz.sub' (ModuleNotFoundError: No "
        "module named 'labmissing_xyz'): not installed or not on sys.path"
    )


@pytest.mark.parametrize(
    "name,message",
    [
        ("labmod:Nope", "'labmod' has no attribute 'Nope'"),
        ("labmod:Circle.nope", "'labmod:Circle' has no attribute 'nope'"),
        (
            "labmod:CONSTANT",
            (
                "'labmod:CONSTANT' is not callable (int); a loss factory is a function or nn.Module "
                "class called as factory(num_classes=..., embedding_dim=..., **hyperparameters)"
            ),
        ),
        (
            "labmod:no_sizes",
            (
                "labmod:no_sizes(margin=0.5) does not take num_classes and embedding_dim as keyword "
                "arguments; a loss factory is called as factory(num_classes=..., embedding_dim=..., "
                "**hyperparameters)"
            ),
        ),
        (
            "labmod:positional_only",
            (
                "labmod:positional_only(num_classes, embedding_dim, /) does not take "
                "num_classes and embedding_dim as keyword arguments"
            ),
        ),
        ("labmod:NoArgs", "labmod:NoArgs() does not take num_classes and embedding_dim as keyword arguments"),
        (
            "labmod:",
            (
                "'labmod:' is not an import path 'module:attribute' (e.g. 'mylab.losses:CircleLoss'), and "
                "'labmod' is not a loss wrapper (l2_reg, sec)"
            ),
        ),
        ("lab-mod:Loss", "'lab-mod:Loss' is not an import path 'module:attribute'"),
        ("labmod:a:b", "'labmod:a:b' is not an import path 'module:attribute'"),
    ],
)
def test_bad_import_paths(labmod, name, message):
    full = _one_line_error(name)
    assert full.startswith(f"loss {name!r}: {message}"), full
    with pytest.raises(LossPluginError):
        loss_info(name)  # the same check when a config is parsed, before anything is built


def test_bad_hyperparameters_and_factories(labmod):
    assert _one_line_error("labmod:PlainProxy", temperature=1.0, margin=2) == (
        "loss 'labmod:PlainProxy': unknown parameter(s) margin, temperature; accepted: scale"
    )
    assert _one_line_error("sec:labmod:pair_loss", scale=1) == (
        "loss 'labmod:pair_loss': unknown parameter(s) scale; accepted: margin"
    )
    assert _one_line_error("labmod:needs_margin") == "loss 'labmod:needs_margin': missing a required argument: 'margin'"
    build_loss("labmod:needs_margin", **KW, margin=0.1)
    assert _one_line_error("labmod:not_a_module") == (
        "loss 'labmod:not_a_module': the factory returned a function, not a torch.nn.Module"
    )
