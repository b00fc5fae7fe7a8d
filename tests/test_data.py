"""dml_core.data: ImageTable / ImageDataset, readers, synthetic data, protocol transforms, fold-fill check."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dml_core.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageDataset,
    ImageTable,
    check_classes_fill_folds,
    decode_image,
    eval_transform,
    read_omniglot,
    synthetic,
    train_transform,
)
from dml_core.datasets import read_image_folder
from dml_core.shards import CorruptImageError

OMNIGLOT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "omniglot"
needs_omniglot = pytest.mark.skipif(
    not any(OMNIGLOT.glob("images_*.zip")), reason=f"Omniglot zips not found at ../shared/data/omniglot ({OMNIGLOT})"
)


def _encode(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _rgb(seed: int, h: int = 20, w: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# --------------------------------------------------------------------------------------------- ImageTable


def test_image_table_rejects_bad_input_with_the_field_named():
    with pytest.raises(ValueError, match="2 images but 3 labels"):
        ImageTable([b"a", b"b"], np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integer class ids"):
        ImageTable([b"a"], np.array([0.5]))
    with pytest.raises(ValueError, match="negative at rows \\[1\\]"):
        ImageTable([b"a", b"b"], np.array([0, -1]))
    with pytest.raises(ValueError, match="class_names has 1 names for 2 distinct labels"):
        ImageTable([b"a", b"b"], np.array([0, 1]), class_names=["x"])
    with pytest.raises(ValueError, match=r"meta\['split'\] has 1 rows, expected 2"):
        ImageTable([b"a", b"b"], np.array([0, 1]), meta={"split": np.array(["train"])})


def test_subset_and_take_keep_labels_names_and_meta_aligned():
    t = ImageTable(
        list("abcdef"),
        np.array([3, 1, 3, 7, 1, 7]),
        class_names=["one", "three", "seven"],
        meta={"split": np.array(list("xyzuvw"))},
    )
    s = t.subset([7, 1])
    assert s.images == ["b", "d", "e", "f"]
    assert s.labels.tolist() == [1, 7, 1, 7] and s.labels.dtype == np.int64
    assert s.class_names == ["one", "seven"]
    assert s.meta["split"].tolist() == ["y", "u", "v", "w"]
    k = t.take([5, 0])
    assert k.images == ["f", "a"] and k.labels.tolist() == [7, 3] and k.class_names == ["three", "seven"]


# --------------------------------------------------------------------------------------------- decoding


def test_decode_image_accepts_bytes_paths_and_arrays_and_always_returns_rgb(tmp_path):
    rgb = _rgb(0)
    assert np.array_equal(np.asarray(decode_image(_encode(rgb, "PNG"))), rgb)
    path = tmp_path / "x.png"
    path.write_bytes(_encode(rgb, "PNG"))
    assert np.array_equal(np.asarray(decode_image(str(path))), rgb)
    assert np.array_equal(np.asarray(decode_image(rgb)), rgb)
    gray = (np.arange(600).reshape(20, 30) % 256).astype(np.uint8)
    out = np.asarray(decode_image(gray))
    assert out.shape == (20, 30, 3) and all(np.array_equal(out[..., c], gray) for c in range(3))
    one_bit = Image.fromarray(gray > 100).convert("1")  # Omniglot's format
    buf = io.BytesIO()
    one_bit.save(buf, format="PNG")
    out = np.asarray(decode_image(buf.getvalue()))
    assert out.shape == (20, 30, 3) and set(np.unique(out).tolist()) == {0, 255}
    with pytest.raises(TypeError, match="unsupported image type int"):
        decode_image(3)
    with pytest.raises(ValueError, match="uint8"):
        decode_image(np.zeros((4, 4), np.float32))


def test_image_dataset_returns_tensor_and_label_and_names_the_row_that_fails():
    good = _encode(_rgb(1), "JPEG")
    t = ImageTable([good, b"not an image at all"], np.array([4, 9]), meta={"relpath": np.array(["a.jpg", "b.jpg"])})
    ds = ImageDataset(t)
    x, y = ds[0]
    assert x.shape == (3, 20, 30) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1 and y == 4
    assert ds.labels.tolist() == [4, 9]
    with pytest.raises(CorruptImageError, match=r"row 1 \(b.jpg\)"):
        ds[1]


# --------------------------------------------------------------------------------------------- transforms


def test_eval_transform_resizes_then_centre_crops_and_normalises():
    # A constant image: every output pixel is the normalised constant, whatever the resampling.
    img = Image.fromarray(np.full((300, 400, 3), 128, np.uint8))
    x = eval_transform(227)(img)
    assert x.shape == (3, 227, 227) and x.dtype == torch.float32
    expect = (128 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(x.mean((1, 2)), expect, atol=1e-5)
    # Resize(round(size·256/227)) then CenterCrop: a left/right split image keeps its split in the middle.
    arr = np.zeros((64, 128, 3), np.uint8)
    arr[:, 64:] = 255
    x = eval_transform(32)(Image.fromarray(arr))  # short side -> 36, long side -> 72; centre crop 32 of 72
    assert x.shape == (3, 32, 32)
    assert (x[:, :, :15] < 0).all() and (x[:, :, 17:] > 0).all()


def test_transforms_turn_grayscale_into_three_equal_channels():
    gray = Image.fromarray((np.arange(48 * 48).reshape(48, 48) % 251).astype(np.uint8))  # mode "L"
    for tf in (eval_transform(32), train_transform(32)):
        torch.manual_seed(0)
        x = tf(gray)
        assert x.shape == (3, 32, 32)
        # identical raw channels -> channels differ only by the per-channel normalisation
        raw = x * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None]
        assert torch.allclose(raw[0], raw[1], atol=1e-5) and torch.allclose(raw[0], raw[2], atol=1e-5)


def test_train_transform_is_random_but_reproducible_under_manual_seed():
    img = Image.fromarray(_rgb(3, 64, 80))
    tf = train_transform(32)
    torch.manual_seed(123)
    a = [tf(img) for _ in range(3)]
    torch.manual_seed(123)
    b = [tf(img) for _ in range(3)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], a[1])  # crops/flips differ between draws
    assert all(t.shape == (3, 32, 32) for t in a)


# --------------------------------------------------------------------------------------------- readers


def test_read_image_folder_follows_imagefolder_order(tmp_path):
    for cls, n in (("zebra", 2), ("apple", 3), ("mango", 1)):
        for i in range(n):
            d = tmp_path / cls / ("nested" if i == 2 else "")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"img{i}.JPG").write_bytes(_encode(_rgb(i), "JPEG"))
    (tmp_path / "apple" / "notes.txt").write_text("not an image")
    t = read_image_folder(tmp_path)
    assert t.class_names == ["apple", "mango", "zebra"]
    assert t.labels.tolist() == [0, 0, 0, 1, 2, 2]
    assert t.meta["relpath"].tolist()[:3] == ["apple/img0.JPG", "apple/img1.JPG", "apple/nested/img2.JPG"]
    assert np.asarray(decode_image(t.images[0])).shape == (20, 30, 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"without images: \['empty'\]"):
        read_image_folder(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_image_folder(tmp_path / "missing")


@needs_omniglot
def test_read_omniglot_real_zips_give_242_classes_and_4840_images():
    t = read_omniglot(OMNIGLOT)
    assert len(t) == 4840 and len(t.class_names) == 242
    _, counts = np.unique(t.labels, return_counts=True)
    assert (counts == 20).all()
    assert t.class_names == sorted(t.class_names)
    assert len({n.split("/")[0] for n in t.class_names}) == 8
    # Greek and Latin are in both zips: each of their files appears once
    rel = t.meta["relpath"].tolist()
    assert len(set(rel)) == len(rel)
    assert sum(n.startswith("Greek/") for n in t.class_names) == 24
    im = decode_image(t.images[0])
    assert im.size == (105, 105) and im.mode == "RGB"
    assert t.labels[0] == 0 and t.class_names[0] == rel[0].rsplit("/", 1)[0]


def _zip_with(path: Path, root: str, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(f"{root}/{name}", data)


def test_read_omniglot_deduplicates_identical_files_and_rejects_conflicting_ones(tmp_path):
    a, b, c = (_encode(_rgb(i, 8, 8), "PNG") for i in range(3))
    _zip_with(
        tmp_path / "images_background_small1.zip",
        "images_background_small1",
        {"Greek/character01/x_01.png": a, "Greek/character01/x_02.png": b, "Korean/character01/k_01.png": c},
    )
    _zip_with(
        tmp_path / "images_background_small2.zip",
        "images_background_small2",
        {"Greek/character01/x_01.png": a, "Tagalog/character02/t_01.png": b},
    )
    t = read_omniglot(tmp_path)
    assert t.class_names == ["Greek/character01", "Korean/character01", "Tagalog/character02"]
    assert t.labels.tolist() == [0, 0, 1, 2] and t.images[0] == a
    _zip_with(tmp_path / "images_background_small3.zip", "images_background_small3", {"Greek/character01/x_01.png": c})
    with pytest.raises(ValueError, match="Greek/character01/x_01.png differs between"):
        read_omniglot(tmp_path)


# --------------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_and_shaped():
    a, b, c = synthetic(6, 5, 24, seed=1), synthetic(6, 5, 24, seed=1), synthetic(6, 5, 24, seed=2)
    assert len(a) == 30 and a.labels.tolist() == np.repeat(np.arange(6), 5).tolist()
    assert a.images[0].shape == (24, 24, 3) and a.images[0].dtype == np.uint8
    assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images))
    assert not all(np.array_equal(x, y) for x, y in zip(a.images, c.images))
    assert a.class_names[0] == "synthetic_0000"
    with pytest.raises(ValueError, match="num_classes must be a positive integer"):
        synthetic(0, 5)
    with pytest.raises(ValueError, match="parts_per_mode must be <= 4"):
        synthetic(2, 2, parts_per_mode=5)


def test_synthetic_4000_images_generate_fast():
    synthetic(4, 4, 32, seed=0)  # warm-up (imports)
    t0 = time.process_time()  # CPU time: robust to other processes on a shared machine
    t = synthetic(100, 40, 32, seed=0)
    cpu = time.process_time() - t0
    assert len(t) == 4000
    assert cpu < 2.0, f"synthetic(100, 40, 32) took {cpu:.2f} s CPU"


def test_synthetic_classes_have_two_distinct_modes():
    """Each class's two modes are separate clusters: an image is closer to its own mode's mean than to the
    other mode's mean of the same class, and the two mode means differ by much more than image jitter."""
    t = synthetic(10, 40, 32, seed=0)
    x = np.stack(t.images).reshape(len(t), -1).astype(np.float32)
    mode = t.meta["mode"]
    correct = 0
    for c in range(10):
        rows = t.labels == c
        means = [x[rows & (mode == m)].mean(0) for m in (0, 1)]
        d = np.stack([np.linalg.norm(x[rows] - mu, axis=1) for mu in means], 1)
        correct += int((d.argmin(1) == mode[rows]).sum())
    assert correct / len(t) > 0.95


@pytest.mark.slow
def test_training_on_half_the_synthetic_classes_improves_map_at_r_on_the_unseen_half():
    """Shared structure: features learnt on classes 0..19 embed the unseen classes 20..39 much better than the
    untrained model (MAP@R measured with dml_core.evaluation.metrics, model = the `tiny` EmbeddingModel)."""
    import torch.nn.functional as F

    from dml_core.evaluation.metrics import retrieval_metrics
    from dml_core.models import EmbeddingModel

    torch.set_num_threads(1)
    n_classes, per_class = 40, 16
    table = synthetic(n_classes, per_class, 32, seed=0)
    ds = ImageDataset(table, eval_transform(32))
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.as_tensor(table.labels)
    seen = y < n_classes // 2
    x_tr, y_tr, x_te, y_te = x[seen], y[seen], x[~seen], y[~seen]

    torch.manual_seed(0)
    model = EmbeddingModel(trunk="tiny", embedding_dim=64, freeze_bn=False)

    def map_at_r_unseen() -> float:
        model.eval()
        with torch.no_grad():
            e = model(x_te)
        model.train()
        return retrieval_metrics(e, y_te)["map_at_r"]

    def contrastive(e, labels, neg_margin=0.5):
        # Hadsell et al. contrastive loss on cosine distances; mean over non-zero terms (as PML reduces).
        d = torch.cdist(F.normalize(e, dim=1), F.normalize(e, dim=1))
        same = labels[:, None] == labels[None, :]
        pos = d[same & ~torch.eye(len(labels), dtype=torch.bool)]
        neg = F.relu(neg_margin - d[~same])
        return pos.mean() + (neg[neg > 0].mean() if (neg > 0).any() else neg.sum())

    before = map_at_r_unseen()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    by_class = [np.flatnonzero(y_tr.numpy() == c) for c in range(n_classes // 2)]
    for _ in range(200):
        classes = rng.choice(n_classes // 2, 8, replace=False)
        idx = np.concatenate([rng.choice(by_class[c], 4, replace=False) for c in classes])
        loss = contrastive(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = map_at_r_unseen()
    assert after > before + 0.15 and after > 1.8 * before, (before, after)


# --------------------------------------------------------------------------------------------- fold check


def test_check_classes_fill_folds_passes_and_fails_with_a_reason():
    check_classes_fill_folds(np.repeat(np.arange(12), 3))  # 4 folds: 9 train / 3 val classes
    with pytest.raises(ValueError, match="(?s)8 trainval classes cannot fill 4 class-disjoint folds.*6 train classes"):
        check_classes_fill_folds(np.repeat(np.arange(8), 3))
    with pytest.raises(ValueError, match="fewer than 2 samples: 20"):
        check_classes_fill_folds(np.r_[np.repeat(np.arange(12), 3), 20])
    with pytest.raises(ValueError, match=">= 2 val classes"):
        check_classes_fill_folds(np.repeat(np.arange(7), 2), classes_per_batch=4)
    # classes with fewer than m images are fine (sampled with replacement, as MLRC)
    check_classes_fill_folds(np.repeat(np.arange(12), 2), m=4)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        check_classes_fill_folds(np.repeat(np.arange(12), 3), m=0)
