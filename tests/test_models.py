"""Embedding models: shapes, pooling and LayerNorm placement, torchvision equivalence, local-only pretrained
weights, frozen BatchNorm (MLRC), parameter groups."""

from __future__ import annotations

import copy
import urllib.request

import pytest
import torch
import torchvision
from torch import nn

from dml_core.models import TRUNKS, EmbeddingModel, GlobalPooling, build_model

torch.set_num_threads(1)


def _images(n=2, size=32, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------------------
# shapes and architecture


@pytest.mark.parametrize("size", [16, 32, 64])
@pytest.mark.parametrize("pooling", ["avg", "max", "avg+max", "gem", "gem:1.5", "kmax:1", "kmax:4"])
def test_tiny_trunk_any_size_and_pooling(size, pooling):
    model = EmbeddingModel("tiny", pooling=pooling, embedding_dim=7)
    out = model(_images(3, size))
    assert out.shape == (3, 7) and model.embedding_dim == 7 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "trunk, feature_dim", [("resnet18", 512), ("resnet50", 2048), ("googlenet", 1024), ("bninception", 1024)]
)
def test_torchvision_trunks_forward(trunk, feature_dim):
    model = build_model(trunk=trunk, pooling="avg+max", layer_norm=True, embedding_dim=16)
    model.eval()
    with torch.no_grad():
        feats = model.pooled_features(_images(2, 32))
        out = model(_images(2, 32))
    assert feats.shape == (2, feature_dim) and model.feature_dim == feature_dim
    assert out.shape == (2, 16)


def test_pooling_is_avg_max_or_their_sum():
    model = EmbeddingModel("tiny", pooling="avg+max", freeze_bn=False).eval()
    x = _images(2, 32)
    with torch.no_grad():
        fmap = model.trunk(x)
        assert fmap.dim() == 4 and fmap.shape[2:] == (4, 4)
        avg = fmap.mean(dim=(2, 3))
        mx = fmap.flatten(2).max(dim=2).values
        torch.testing.assert_close(model.pooled_features(x), avg + mx)
        model.pool.mode = "avg"
        torch.testing.assert_close(model.pooled_features(x), avg)
        model.pool.mode = "max"
        torch.testing.assert_close(model.pooled_features(x), mx)


def test_gem_is_the_generalised_mean_with_cubic_default():
    """MPA §4.2 "cubic GeM": (mean_hw clamp(x, 1e-6)^3)^(1/3); p = 1 is average pooling; large p tends to max."""
    fmap = torch.rand(3, 5, 4, 4, generator=torch.Generator().manual_seed(1)) + 0.01
    gem = GlobalPooling("gem")
    assert gem.arg == 3.0
    want = fmap.pow(3).mean(dim=(2, 3)).pow(1 / 3)
    torch.testing.assert_close(gem(fmap), want)
    torch.testing.assert_close(GlobalPooling("gem:1")(fmap), fmap.mean(dim=(2, 3)))
    avg, mx = fmap.mean(dim=(2, 3)), fmap.amax(dim=(2, 3))
    assert (avg <= gem(fmap) + 1e-6).all() and (gem(fmap) <= mx + 1e-6).all()
    torch.testing.assert_close(GlobalPooling("gem:200")(fmap.double()), mx.double(), rtol=0.02, atol=0)
    # negative activations are clamped to 1e-6 (the fractional power stays defined), and the gradient is finite
    x = torch.full((1, 2, 2, 2), -1.0, requires_grad=True)
    out = gem(x)
    torch.testing.assert_close(out, torch.full((1, 2), 1e-6))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_kmax_pooling_interpolates_between_max_and_avg():
    """ProxyNCA++ Eq. 7: per channel the mean of the K largest activations; K = 1 is GMP, K = H·W is GAP, and the
    output does not increase with K (ProxyNCA++ §3.5, Eq. 7)."""
    g = torch.randn(2, 2048, 8, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(GlobalPooling("kmax:1")(g), g.amax(dim=(2, 3)))
    torch.testing.assert_close(GlobalPooling("kmax:64")(g), g.mean(dim=(2, 3)))
    outs = [GlobalPooling(f"kmax:{k}")(g) for k in (1, 2, 4, 8, 16, 32, 64)]
    assert all((a >= b - 1e-6).all() for a, b in zip(outs, outs[1:]))
    k3 = torch.tensor([[[[1.0, 5.0], [3.0, 2.0]]]])
    torch.testing.assert_close(GlobalPooling("kmax:3")(k3), torch.tensor([[(5.0 + 3.0 + 2.0) / 3]]))
    with pytest.raises(ValueError, match=r"K = 65 exceeds the 8×8 = 64 positions"):
        GlobalPooling("kmax:65")(g)


def test_layer_norm_sits_between_pooling_and_linear_without_affine():
    model = EmbeddingModel("tiny", pooling="max", layer_norm=True).eval()
    assert list(model.embedder._modules) == ["layer_norm", "linear"]
    ln = model.embedder.layer_norm
    assert isinstance(ln, nn.LayerNorm) and not ln.elementwise_affine and list(ln.parameters()) == []
    seen = {}
    model.embedder.linear.register_forward_hook(lambda m, inp, out: seen.update(x=inp[0]))
    with torch.no_grad():
        out = model(_images(3, 32))
        h = model.pooled_features(_images(3, 32))
    # the linear layer sees the pooled features normalised per sample: (h - mean) / sqrt(var + 1e-5)
    expected = (h - h.mean(dim=1, keepdim=True)) / torch.sqrt(h.var(dim=1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(seen["x"], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, model.embedder.linear(expected), atol=1e-5, rtol=1e-4)
    assert list(EmbeddingModel("tiny").embedder._modules) == ["linear"]


def test_resnet18_trunk_with_avg_pooling_equals_torchvision_penultimate_features():
    torch.manual_seed(0)
    model = EmbeddingModel("resnet18", pooling="avg").eval()
    ref = torchvision.models.resnet18(weights=None)
    ref.load_state_dict({**model.trunk.state_dict(), "fc.weight": ref.fc.weight, "fc.bias": ref.fc.bias})
    ref.fc = nn.Identity()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.pooled_features(_images(2, 64)), ref(_images(2, 64)))


def test_parameter_groups_cover_the_model_once():
    model = EmbeddingModel("tiny", layer_norm=True)
    trunk = {id(p) for p in model.trunk.parameters()}
    embedder = {id(p) for p in model.embedder.parameters()}
    assert trunk and embedder and not trunk & embedder
    assert trunk | embedder == {id(p) for p in model.parameters()}
    assert any(m is model.embedder.layer_norm for m in model.embedder.modules())


def test_outputs_are_raw_not_normalised():
    out = EmbeddingModel("tiny", embedding_dim=32).eval()(_images(4, 32))
    assert not torch.allclose(out.norm(dim=1), torch.ones(4))


# --------------------------------------------------------------------------------------------------------------
# frozen BatchNorm


def _bn_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("trunk", ["tiny", "googlenet", "bninception"])
def test_frozen_bn_keeps_running_statistics_in_train_mode(trunk):
    model = EmbeddingModel(trunk, freeze_bn=True)
    model.eval()
    model.train()  # switching back must not unfreeze BN
    assert model.training
    bns = [m for m in model.trunk.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns and not any(m.training for m in bns)
    before = _bn_state(model)
    x = _images(4, 32) * 3 + 1
    out_train = model(x)
    after = _bn_state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # with BN frozen and no dropout in the model, train-mode output equals eval-mode output
    torch.testing.assert_close(out_train, model.eval()(x))


def test_unfrozen_bn_updates_running_statistics():
    model = EmbeddingModel("tiny", freeze_bn=False).train()
    before = _bn_state(model)
    model(_images(4, 32) * 3 + 1)
    after = _bn_state(model)
    assert any(not torch.equal(before[k], after[k]) for k in before if "running_mean" in k)


def test_frozen_bn_affine_is_trained_like_mlrc_unless_freeze_bn_affine():
    # MLRC (PML maybe_freeze_trunk_batchnorm) only puts BN in eval mode: its weight/bias still get gradients.
    model = EmbeddingModel("tiny", freeze_bn=True)
    model(_images(2, 16)).sum().backward()
    bn = model.trunk[1]
    assert isinstance(bn, nn.BatchNorm2d) and bn.weight.grad is not None and bn.weight.grad.abs().sum() > 0

    frozen = EmbeddingModel("tiny", freeze_bn=True, freeze_bn_affine=True)
    frozen(_images(2, 16)).sum().backward()
    bns = [m for m in frozen.trunk.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(not p.requires_grad and p.grad is None for m in bns for p in m.parameters())
    assert frozen.trunk[0].weight.grad is not None  # convolutions still train
    with pytest.raises(ValueError, match="freeze_bn_affine"):
        EmbeddingModel("tiny", freeze_bn=False, freeze_bn_affine=True)


# --------------------------------------------------------------------------------------------------------------
# pretrained weights: local files only


def test_constructing_every_trunk_touches_no_network_or_hub(tmp_path, monkeypatch):
    hub = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(hub))

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_network)
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", no_network)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    for trunk in TRUNKS:
        EmbeddingModel(trunk)
    assert not hub.exists()


def test_pretrained_resnet18_state_dict_is_loaded_from_a_local_file(tmp_path):
    torch.manual_seed(1)
    source = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)  # a full classifier state_dict, fc.* included
    model = build_model(trunk="resnet18", pretrained=str(path))
    expected = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    got = model.trunk.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_pretrained_googlenet_with_aux_heads_loads_and_transforms_input_like_torchvision(tmp_path):
    torch.manual_seed(2)
    source = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=False)
    path = tmp_path / "googlenet.pth"
    torch.save(source.state_dict(), path)  # the downloadable file carries aux1/aux2 entries
    model = EmbeddingModel("googlenet", pretrained=path).eval()
    ref = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False, transform_input=True)
    ref.load_state_dict(source.state_dict(), strict=False)
    ref.fc = nn.Identity()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.pooled_features(_images(2, 64)), ref(_images(2, 64)))


def test_every_builtin_model_records_the_preprocessing_its_trunk_expects():
    from dml_core.trunks import BNINCEPTION_PREPROCESSING, IMAGENET_PREPROCESSING, trunk_preprocessing

    assert EmbeddingModel("bninception").preprocessing == BNINCEPTION_PREPROCESSING
    for trunk in ("tiny", "resnet18"):
        pre = EmbeddingModel(trunk).preprocessing
        assert pre == trunk_preprocessing(trunk)
        assert (pre.mean, pre.std, pre.channel_order, pre.value_scale) == (
            IMAGENET_PREPROCESSING.mean,
            IMAGENET_PREPROCESSING.std,
            "RGB",
            1.0,
        )


def test_missing_pretrained_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "resnet50.pth"
    with pytest.raises(FileNotFoundError, match="nope/resnet50.pth"):
        EmbeddingModel("resnet50", pretrained=missing)


def test_pretrained_file_for_another_architecture_is_rejected(tmp_path):
    path = tmp_path / "tiny.pth"
    torch.save(EmbeddingModel("tiny").trunk.state_dict(), path)
    with pytest.raises(ValueError, match=r"tiny\.pth.*does not match trunk 'resnet18'"):
        EmbeddingModel("resnet18", pretrained=path)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pth.*could not be read"):
        EmbeddingModel("tiny", pretrained=junk)
    # a tiny trunk accepts its own state_dict (e.g. from an earlier run)
    loaded = EmbeddingModel("tiny", pretrained=path)
    assert loaded.trunk[0].weight.shape == (32, 3, 3, 3)


# --------------------------------------------------------------------------------------------------------------
# arguments


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"trunk": "alexnet"}, r"unknown trunk 'alexnet': a trunk is a built-in name \(tiny, resnet18"),
        ({"trunk": "resnet5O"}, "did you mean 'resnet50'"),
        ({"trunk": ""}, "trunk must be a non-empty name"),
        ({"trunk": "tiny", "pooling": "median"}, "pooling must be one of avg, max"),
        ({"trunk": "tiny", "pooling": "max:2"}, "pooling must be one of"),
        ({"trunk": "tiny", "pooling": "gem:0.5"}, "GeM's p must be a finite number >= 1"),
        ({"trunk": "tiny", "pooling": "gem:x"}, "GeM's p must be"),
        ({"trunk": "tiny", "pooling": "kmax"}, "needs a positive integer K"),
        ({"trunk": "tiny", "pooling": "kmax:0"}, "needs a positive integer K"),
        ({"trunk": "tiny", "embedding_dim": 0}, "embedding_dim"),
        ({"trunk": "tiny", "layer_norm": "yes"}, "layer_norm must be a bool"),
        ({"trunk": "tiny", "dropout": 0.1}, r"unknown model field\(s\) \['dropout'\]"),
        ({"pooling": "avg"}, "'trunk' is required"),
    ],
)
def test_build_model_rejects_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(**kwargs)


def test_images_must_be_three_channel_batches():
    model = EmbeddingModel("tiny")
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\).*\(2, 1, 32, 32\)"):
        model(torch.zeros(2, 1, 32, 32))


def test_build_model_matches_the_constructor_and_deepcopies():
    cfg = {"trunk": "tiny", "pooling": "max", "layer_norm": True, "embedding_dim": 24, "freeze_bn": False}
    model = build_model(**cfg)
    assert (model.pooling, model.layer_norm, model.embedding_dim, model.freeze_bn) == ("max", True, 24, False)
    clone = copy.deepcopy(model)  # train_fold keeps best_state copies
    x = _images(2, 32)
    torch.testing.assert_close(clone.eval()(x), model.eval()(x))
