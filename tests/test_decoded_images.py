"""Images decoded once per fold (dml_core.decoded) and the machine's numerics (dml_core.training.numerics): the decoded
evaluation tensors are the streaming transform's, the batched training augmentation has the protocol's
properties, the memory bound picks the path, "auto" follows the CPU's flags, and a fold records its numerics."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image

import dml_core.decoded as decoded
import dml_core.training.numerics as numerics
from dml_core.data import ImageDataset, ImageTable, eval_transform, synthetic, train_transform
from dml_core.decoded import (
    DecodedBatches,
    DecodedEvalSet,
    decode_eval_set,
    decode_fold,
    decode_train_set,
    random_resized_crop_params,
)
from dml_core.models import build_model
from dml_core.training.loop import FoldResult, TrainConfig, train_fold
from dml_core.trunks import trunk_preprocessing

SIZE = 24


def _png(a: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def _omniglot_like(n_classes: int = 6, per_class: int = 4, side: int = 45, seed: int = 0) -> ImageTable:
    """1-bit PNGs like Omniglot's."""
    rng = np.random.default_rng(seed)
    images = [_png((rng.random((side, side)) > 0.7).astype(np.uint8) * 255, "1") for _ in range(n_classes * per_class)]
    return ImageTable(images=images, labels=np.repeat(np.arange(n_classes), per_class))


def _mixed_sizes(seed: int = 1) -> ImageTable:
    """RGB arrays and grayscale PNGs of different sizes (the decoded table pads them)."""
    rng = np.random.default_rng(seed)
    rows: list = []
    for i in range(12):
        h, w = int(rng.integers(20, 60)), int(rng.integers(20, 60))
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        rows.append(a if i % 2 else _png(a, "L"))
    return ImageTable(images=rows, labels=np.repeat(np.arange(4), 3))


# --------------------------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize(
    "table", [_omniglot_like(), _mixed_sizes(), synthetic(4, 3, 40, 0)], ids=["1bit", "mixed", "rgb"]
)
@pytest.mark.parametrize("prep", [None, "bninception"])
def test_decoded_eval_tensors_are_the_streaming_transforms_exactly(table, prep):
    pre = trunk_preprocessing(prep) if prep else None
    stream = ImageDataset(table, eval_transform(SIZE, pre))
    dec = decode_eval_set(stream)
    assert isinstance(dec, DecodedEvalSet) and len(dec) == len(stream)
    expected = torch.stack([stream[i][0] for i in range(len(stream))])
    assert torch.equal(dec.batch(0, len(dec)), expected)
    assert torch.equal(dec.batch(3, 7), expected[3:7])
    x, label = dec[5]
    assert torch.equal(x, stream[5][0]) and label == stream[5][1]
    np.testing.assert_array_equal(dec.labels, stream.labels)


def test_embedding_a_decoded_val_set_gives_the_streaming_embeddings():
    from dml_core.evaluation.embedding import embed

    stream = ImageDataset(synthetic(4, 5, 40, 0), eval_transform(SIZE))
    model = build_model(trunk="tiny", embedding_dim=8, freeze_bn=False)
    a, la = embed(model, stream, batch_size=7)
    b, lb = embed(model, decode_eval_set(stream), batch_size=7)
    assert torch.equal(la, lb)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- training


def test_train_batches_have_the_protocols_shape_range_and_steps():
    stream = ImageDataset(_omniglot_like(), train_transform(SIZE))
    dec = decode_train_set(stream)
    assert dec is not None and dec.pixels.shape[1] == 1  # 1-bit rows stored as one channel
    torch.manual_seed(0)
    x = dec.batch(range(len(dec)))
    assert x.shape == (len(dec), 3, SIZE, SIZE) and x.dtype == torch.float32
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    pixels = (x * std + mean) * 255  # back to ToTensor's 0..255 steps
    assert pixels.min() > -1e-3 and pixels.max() < 255 + 1e-3
    assert torch.allclose(pixels, pixels.round(), atol=1e-3)
    grey = pixels.round()
    assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 1], grey[:, 2])  # grey stays grey


def test_train_batches_repeat_per_seed_and_differ_between_seeds():
    dec = decode_train_set(ImageDataset(_mixed_sizes(), train_transform(SIZE)))
    assert dec is not None and dec.pixels.shape[1] == 3
    torch.manual_seed(3)
    a = dec.batch([0, 1, 2, 3, 4, 5])
    torch.manual_seed(3)
    b = dec.batch([0, 1, 2, 3, 4, 5])
    torch.manual_seed(4)
    c = dec.batch([0, 1, 2, 3, 4, 5])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_flip_mirrors_the_same_crop():
    stream = ImageDataset(synthetic(3, 4, 40, 0), train_transform(SIZE))
    dec = decode_train_set(stream)
    dec.transform.flip_p = 0.0
    torch.manual_seed(11)
    plain = dec.batch(range(12))
    dec.transform.flip_p = 1.0
    torch.manual_seed(11)  # the same draws: the crops, then one flip draw per image
    flipped = dec.batch(range(12))
    assert torch.equal(flipped, plain.flip(-1))


def test_the_whole_image_crop_is_pils_bilinear_resize_within_one_grey_level():
    table = synthetic(3, 4, 40, 0)
    stream = ImageDataset(table, train_transform(SIZE))
    stream.transform.scale, stream.transform.ratio, stream.transform.flip_p = (1.0, 1.0), (1.0, 1.0), 0.0
    dec = decode_train_set(stream)
    torch.manual_seed(0)
    x = dec.batch(range(len(table)))
    pil = torch.stack(
        [
            torch.from_numpy(np.array(Image.fromarray(a).resize((SIZE, SIZE), Image.Resampling.BILINEAR)))
            for a in table.images
        ]
    ).permute(0, 3, 1, 2)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    ours = ((x * std + mean) * 255).round()
    diff = (ours - pil.float()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.9


def test_the_dense_resize_is_pils_on_any_crop(monkeypatch):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (105, 90), dtype=np.uint8)
    boxes = [(0, 0, 105, 90), (10, 5, 42, 60), (50, 30, 55, 40), (3, 70, 20, 20), (90, 80, 15, 10)]  # top, left, h, w
    top, left, h, w = (torch.tensor(v) for v in zip(*boxes))
    dec = decoded.DecodedTrainSet(
        torch.from_numpy(img)[None, None].expand(len(boxes), 1, -1, -1),
        torch.tensor([[105, 90]] * len(boxes)),
        np.zeros(len(boxes), dtype=np.int64),
        train_transform(32),
    )
    dec.transform.flip_p = 0.0
    monkeypatch.setattr(decoded, "random_resized_crop_params", lambda *a: tuple(torch.tensor(v) for v in zip(*boxes)))
    x = dec.batch(range(len(boxes)))
    mean, std = (
        torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1),
    )
    out = ((x * std + mean) * 255).round()[:, 0]
    exact = []
    for k, (t, l, hh, ww) in enumerate(boxes):
        pil = np.array(Image.fromarray(img).crop((l, t, l + ww, t + hh)).resize((32, 32), Image.Resampling.BILINEAR))
        d = np.abs(out[k].numpy() - pil)
        assert d.max() <= 1, k
        exact.append((d == 0).mean())
    assert np.mean(exact) > 0.9, exact


def test_large_images_take_the_streaming_transforms_pil_ops_exactly(monkeypatch):
    monkeypatch.setattr(decoded, "DENSE_MAX_PIXELS", 0)  # every image "large": one PIL resize per image
    stream = ImageDataset(_mixed_sizes(), train_transform(SIZE))
    dec = decode_train_set(stream)
    assert dec is not None and not dec.dense
    rows = [3, 0, 7, 7, 11]
    torch.manual_seed(5)
    expected = torch.stack([stream[i][0] for i in rows])
    torch.manual_seed(5)
    assert torch.equal(dec.batch(rows), expected)


def test_crop_draws_follow_torchvisions_distribution():
    from scipy.stats import ks_2samp

    tf = train_transform(SIZE)
    n = 4000
    torch.manual_seed(0)
    ref = np.array([tf.crop_params(105, 80) for _ in range(n)])
    torch.manual_seed(1)
    top, left, h, w = random_resized_crop_params(torch.full((n,), 105), torch.full((n,), 80), tf.scale, tf.ratio)
    ours = torch.stack([top, left, h, w], 1).numpy()
    assert ((ours[:, 0] + ours[:, 2] <= 105) & (ours[:, 1] + ours[:, 3] <= 80) & (ours.min(1) >= 0)).all()
    for k in range(4):  # top, left, height, width: the same distributions
        assert ks_2samp(ref[:, k], ours[:, k]).pvalue > 1e-3, k


def test_no_try_fits_gives_torchvisions_centre_crop():
    # a 1 × 200 strip: no crop of ratio 3/4 … 4/3 with area >= 16 % fits, as crop_params' fallback
    tf = train_transform(SIZE)
    torch.manual_seed(0)
    got = [int(v) for v in random_resized_crop_params(torch.tensor([1]), torch.tensor([200]), tf.scale, tf.ratio)]
    assert tuple(got) == tf.crop_params(1, 200)


# --------------------------------------------------------------------------------------------- the bound


def test_the_memory_bound_chooses_the_path():
    table = _omniglot_like()
    train = ImageDataset(table.subset([0, 1, 2, 3]), train_transform(SIZE))
    val = ImageDataset(table.subset([4, 5]), eval_transform(SIZE))
    val_bytes = len(val) * 3 * SIZE * SIZE
    train_bytes = len(train) * 1 * 45 * 45  # 1-bit: one channel
    t, v = decode_fold(train, val, max_bytes=val_bytes + train_bytes)
    assert t is not None and isinstance(v, DecodedEvalSet) and t.nbytes == train_bytes and v.nbytes == val_bytes
    t, v = decode_fold(train, val, max_bytes=val_bytes + train_bytes - 1)  # val fits, train no longer does
    assert t is None and isinstance(v, DecodedEvalSet)
    t, v = decode_fold(train, val, max_bytes=val_bytes - 1)  # nothing fits: both stream
    assert t is None and v is val
    # not the protocol's datasets (no transform, another transform): streamed as they are
    assert decode_fold(ImageDataset(table), ImageDataset(table, train_transform(SIZE)))[1].transform is not None
    assert decode_train_set(ImageDataset(table, eval_transform(SIZE))) is None


def test_a_fold_decodes_each_image_once_and_streams_above_the_bound(monkeypatch):
    calls = {"n": 0}
    decode = ImageDataset.decode

    def counting(self, i, *, rgb=True):
        calls["n"] += 1
        return decode(self, i, rgb=rgb)

    monkeypatch.setattr(ImageDataset, "decode", counting)
    table = synthetic(12, 4, 32, 0)
    cfg = TrainConfig(iters_per_epoch=5, max_epochs=2, eval_every=1, patience=None, classes_per_batch=4, m=2)

    def run() -> tuple[FoldResult, int]:
        calls["n"] = 0
        torch.manual_seed(0)
        model = build_model(trunk="tiny", embedding_dim=8, freeze_bn=False)
        loss = torch.nn.Module()
        loss.forward = lambda emb, labels: emb.pow(2).mean()  # type: ignore[method-assign]
        train = ImageDataset(table.subset(range(8)), train_transform(16))
        val = ImageDataset(table.subset(range(8, 12)), eval_transform(16))
        return train_fold(model, loss, train, val, cfg), calls["n"]

    res, n = run()
    assert res.status == "ok" and n == 32 + 16 + min(32, decoded._SAMPLE_ROWS)  # train + val + the size sample
    monkeypatch.setattr(decoded, "DECODE_ONCE_MAX_BYTES", 0)
    res, n = run()
    assert res.status == "ok" and n == 2 * 5 * 8 + 3 * 16  # every batch image and every evaluation's images


def test_decoded_batches_yield_the_samplers_rows_and_labels():
    from dml_core.training.samplers import MPerClassBatchSampler

    dec = decode_train_set(ImageDataset(synthetic(6, 4, 32, 0), train_transform(SIZE)))
    sampler = MPerClassBatchSampler(dec.labels, 2, 3, iters_per_epoch=4, seed=0)
    batches = list(DecodedBatches(dec, sampler))
    assert len(batches) == 4 == len(DecodedBatches(dec, sampler))
    for (x, y), idx in zip(batches, sampler):
        assert x.shape == (6, 3, SIZE, SIZE) and y.tolist() == dec.labels[idx].tolist()


# --------------------------------------------------------------------------------------------- numerics


_CPUINFO = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 {extra}\n\nprocessor\t: 1\n"


@pytest.fixture
def cpuinfo(monkeypatch):
    def use(text):
        monkeypatch.setattr(numerics, "_read_cpuinfo", lambda: text)
        numerics.cpu_flags.cache_clear()
        numerics.cpu_model.cache_clear()

    yield use
    numerics.cpu_flags.cache_clear()
    numerics.cpu_model.cache_clear()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("avx512f avx512_bf16", "bf16+channels_last"),
        ("amx_tile amx_bf16", "bf16+channels_last"),
        ("avx512f", "fp32+channels_last"),
    ],
)
def test_auto_resolves_by_the_cpus_bf16_flags(cpuinfo, flags, expected):
    cpuinfo(_CPUINFO.format(extra=flags))
    cfg = TrainConfig(cpu_amp="auto", channels_last="auto")
    assert numerics.native_bf16() == expected.startswith("bf16")
    assert numerics.resolve_numerics(cfg, "cpu") == expected
    assert numerics.cpu_model() == "Test CPU 9000"


def test_explicit_values_and_cuda_resolve_without_the_flags(cpuinfo):
    cpuinfo(_CPUINFO.format(extra="avx512_bf16"))
    r = numerics.resolve_numerics
    assert r(TrainConfig(), "cpu") == "fp32"
    assert r(TrainConfig(cpu_amp=True), "cpu") == "bf16"
    assert r(TrainConfig(cpu_amp=False, channels_last="auto"), torch.device("cpu")) == "fp32+channels_last"
    assert r(TrainConfig(cpu_amp="auto", channels_last="auto"), "cuda:0") == "cuda-fp32"
    assert r(TrainConfig(amp=True, amp_dtype="fp16", channels_last="auto"), "cuda") == "cuda-amp-fp16+channels_last"
    assert r(TrainConfig(amp=True, channels_last=False), "cuda") == "cuda-amp-bf16"


def test_without_cpuinfo_torchs_probe_answers(cpuinfo):
    cpuinfo(None)
    caps = torch.cpu.get_capabilities()
    assert numerics.native_bf16() == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    assert numerics.cpu_model()  # platform's name, never empty


def test_bad_numerics_values_are_one_clear_error():
    with pytest.raises(ValueError, match=r"TrainConfig.cpu_amp must be true, false or 'auto', got 'yes'"):
        TrainConfig(cpu_amp="yes")
    with pytest.raises(ValueError, match=r"TrainConfig.channels_last must be true, false or 'auto', got 1"):
        TrainConfig(channels_last=1)


def test_the_sweep_config_takes_auto_and_names_a_bad_value(tmp_path):
    from pipelines.config.errors import ConfigError
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config

    doc = demo_config("num", str(tmp_path))
    doc["protocol"].setdefault("train", {}).update(cpu_amp="auto", channels_last="auto")
    cfg = parse_config(copy.deepcopy(doc))
    assert cfg.protocol.train["cpu_amp"] == "auto" and cfg.protocol.train["channels_last"] == "auto"
    doc["protocol"]["train"]["cpu_amp"] = "bf16"
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == "protocol.train.cpu_amp"
    assert str(info.value) == "protocol.train.cpu_amp: expected true, false or 'auto', got 'bf16'"


def test_numerics_stay_out_of_the_protocol_fingerprint(tmp_path):
    from pipelines.config.presets import demo_config
    from pipelines.config.schema import parse_config
    from pipelines.execution.preflight.study_plans import preflight
    from pipelines.execution.studies.fingerprints import study_fingerprints

    hashes = set()
    for amp, cl in [(False, False), ("auto", "auto"), (True, True)]:
        doc = demo_config("fp", str(tmp_path))
        doc["losses"] = ["contrastive"]
        doc["protocol"].setdefault("train", {}).update(cpu_amp=amp, channels_last=cl)
        cfg = parse_config(doc)
        fp = study_fingerprints(cfg, preflight(cfg))["synthetic/contrastive"]
        assert not any("cpu_amp" in k or "channels_last" in k for k in fp.fields)
        hashes.add(fp.hash)
    assert len(hashes) == 1


@pytest.mark.parametrize(
    "amp, cl, flags, expected", [(False, False, "", "fp32"), ("auto", "auto", "avx2", "fp32+channels_last")]
)
def test_a_fold_records_its_numerics(cpuinfo, amp, cl, flags, expected):
    cpuinfo(_CPUINFO.format(extra=flags))
    table = synthetic(12, 4, 32, 0)
    model = build_model(trunk="tiny", embedding_dim=8, freeze_bn=False)
    loss = torch.nn.Module()
    loss.forward = lambda emb, labels: emb.pow(2).mean()  # type: ignore[method-assign]
    cfg = TrainConfig(
        iters_per_epoch=2, max_epochs=1, eval_every=1, classes_per_batch=4, m=2, cpu_amp=amp, channels_last=cl
    )
    res = train_fold(
        model,
        loss,
        ImageDataset(table.subset(range(8)), train_transform(16)),
        ImageDataset(table.subset(range(8, 12)), eval_transform(16)),
        cfg,
    )
    assert res.status == "ok" and res.numerics == expected
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) == expected.endswith("channels_last")
