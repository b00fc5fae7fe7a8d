"""`dmlrc data prepare`: every official layout -> parquet shards + manifest -> streaming reader, round-tripped.

Each fake dataset is written in the dataset's real on-disk layout (a few classes of small generated JPEGs), then
prepared, read back through `read_parquet_manifest`, and compared byte for byte with the source files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from dml_core.data import ImageDataset, eval_transform, read_omniglot, read_parquet_manifest
from dml_core.datasets import dataset_protocol, prepare, protocol_for_table
from dml_core.shards import (
    CorruptImageError,
    ManifestError,
    Record,
    ShardChecksumError,
    ShardedTable,
    verify_shards,
    write_shards,
)

OMNIGLOT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "omniglot"


def jpeg(seed: int, size: int = 16) -> bytes:
    """A small, unique JPEG (random pixels: no two fakes share bytes)."""
    arr = np.random.default_rng(seed).integers(0, 256, (size, size + 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# --------------------------------------------------------------------------------------------- fake layouts


def make_fake_cub(src: Path, n_classes: int = 3, per_class: int = 4) -> dict[str, tuple[int, str, bytes]]:
    """`src/CUB_200_2011/{images.txt,image_class_labels.txt,train_test_split.txt,images/...}`.
    Returns relpath -> (expected label, expected split, bytes)."""
    root = src / "CUB_200_2011"
    expected, lines_img, lines_lab, lines_split = {}, [], [], []
    image_id = 0
    for c in range(1, n_classes + 1):
        cdir = f"{c:03d}.Bird_{chr(64 + c)}"
        for j in range(per_class):
            image_id += 1
            rel = f"{cdir}/Bird_{chr(64 + c)}_{j:04d}.jpg"
            data = jpeg(image_id)
            _write(root / "images" / rel, data)
            train = image_id % 2
            lines_img.append(f"{image_id} {rel}")
            lines_lab.append(f"{image_id} {c}")
            lines_split.append(f"{image_id} {train}")
            expected[f"images/{rel}"] = (c - 1, "train" if train else "test", data)
    (root / "images.txt").write_text("\n".join(lines_img) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(lines_lab) + "\n")
    (root / "train_test_split.txt").write_text("\n".join(lines_split) + "\n")
    return expected


def make_fake_cars(src: Path, n_classes: int = 4, per_class: int = 3) -> dict[str, tuple[int, str, bytes]]:
    """`src/cars_annos.mat` (struct array `annotations` like the official file) + `src/car_ims/*.jpg`."""
    from scipy.io import savemat

    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    n = n_classes * per_class
    ann = np.zeros((1, n), dtype=[(f, object) for f in fields])
    expected = {}
    for i in range(n):
        cls, test = i % n_classes + 1, i % 3 == 0
        rel = f"car_ims/{i + 1:06d}.jpg"
        data = jpeg(100 + i)
        _write(src / rel, data)
        ann[0, i] = (rel, np.uint8(1), np.uint8(2), np.uint8(30), np.uint8(40), np.uint8(cls), np.uint8(test))
        expected[rel] = (cls, "test" if test else "train", data)
    names = np.empty((1, n_classes), dtype=object)
    for c in range(n_classes):
        names[0, c] = f"Make Model {2000 + c}"
    savemat(src / "cars_annos.mat", {"annotations": ann, "class_names": names})
    return expected


def make_fake_sop(src: Path, train_classes=(1, 2, 3), test_classes=(4, 5), per_class: int = 2):
    """`src/Ebay_train.txt`, `src/Ebay_test.txt` (official header) + `src/<super>_final/<product>_<i>.JPG`."""
    expected, image_id = {}, 0
    for split, classes in (("train", train_classes), ("test", test_classes)):
        lines = ["image_id class_id super_class_id path"]
        for c in classes:
            sup = "bicycle_final" if c % 2 else "chair_final"
            for j in range(per_class):
                image_id += 1
                rel = f"{sup}/{111000 + c}_{j}.JPG"
                data = jpeg(200 + image_id)
                _write(src / rel, data)
                lines.append(f"{image_id} {c} {1 + c % 2} {rel}")
                expected[rel] = (c - 1, split, data)
        (src / f"Ebay_{split}.txt").write_text("\n".join(lines) + "\n")
    return expected


def make_fake_inshop(src: Path):
    """`src/Eval/list_eval_partition.txt` (count line, header, rows) + `src/Img/img/...` images."""
    rows = []
    items = {"id_00000007": "train", "id_00000002": "train", "id_00000031": "test", "id_00000015": "test"}
    k = 0
    for item, kind in items.items():
        for j in range(4):
            status = "train" if kind == "train" else ("query" if j < 2 else "gallery")
            rows.append((f"img/WOMEN/Dresses/{item}/{j:02d}_1_front.jpg", item, status))
    expected = {}
    order = sorted(items)
    for name, item, status in rows:
        k += 1
        data = jpeg(300 + k)
        _write(src / "Img" / name, data)
        expected[name] = (order.index(item), status, data)
    text = [str(len(rows)), "image_name item_id evaluation_status"] + [" ".join(r) for r in rows]
    _write(src / "Eval" / "list_eval_partition.txt", ("\n".join(text) + "\n").encode())
    return expected


def _check_round_trip(table: ShardedTable, expected: dict[str, tuple[int, str, bytes]]) -> None:
    assert len(table) == len(expected)
    rel = [table.relpath(i) for i in range(len(table))]
    assert sorted(rel) == sorted(expected)
    for i, r in enumerate(rel):
        label, split, data = expected[r]
        assert table.labels[i] == label, r
        assert table.meta["split"][i] == split, r
        assert table.images[i] == data, r


# --------------------------------------------------------------------------------------------- per format


def test_cub200_round_trip_labels_are_class_id_minus_one(tmp_path):
    expected = make_fake_cub(tmp_path / "src")
    m = prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)
    assert m["dataset"] == "cub200" and m["num_classes"] == 3 and m["num_images"] == 12
    assert [c["name"] for c in m["classes"]] == ["001.Bird_A", "002.Bird_B", "003.Bird_C"]
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    _check_round_trip(t, expected)
    assert t.class_names == ["001.Bird_A", "002.Bird_B", "003.Bird_C"]
    assert "class_id - 1" in m["info"]["label_convention"]
    # the source may also be the CUB_200_2011 directory itself
    m2 = prepare("cub200", tmp_path / "src" / "CUB_200_2011", tmp_path / "out2", progress=False)
    assert m2["shards"][0]["sha256"] == m["shards"][0]["sha256"]


def test_cub200_bad_layouts_fail_naming_file_and_line(tmp_path):
    make_fake_cub(tmp_path / "src")
    root = tmp_path / "src" / "CUB_200_2011"
    text = (root / "image_class_labels.txt").read_text().splitlines()
    text[2] = "3"
    (root / "image_class_labels.txt").write_text("\n".join(text))
    with pytest.raises(ValueError, match=r"image_class_labels.txt line 3: .*expected 2 fields"):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)
    make_fake_cub(tmp_path / "src")
    next((root / "images").rglob("*.jpg")).unlink()
    with pytest.raises(FileNotFoundError, match="1 listed images are missing"):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="images.txt"):
        prepare("cub200", tmp_path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_cars196_round_trip_labels_are_mat_class_ids(tmp_path):
    expected = make_fake_cars(tmp_path / "src")
    m = prepare("cars196", tmp_path / "src", tmp_path / "out", progress=False)
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    _check_round_trip(t, expected)
    assert sorted(set(t.labels.tolist())) == [1, 2, 3, 4]
    assert t.class_names == [f"Make Model {2000 + c}" for c in range(4)]
    assert m["counts"]["per_split"] == {"test": 4, "train": 8}
    p = protocol_for_table(t)
    assert p.trainval_classes.tolist() == [1, 2] and p.test_classes.tolist() == [3, 4]


def test_sop_round_trip_and_the_mlrc_split_is_one_class_off_the_official(tmp_path):
    expected = make_fake_sop(tmp_path / "src")
    prepare("sop", tmp_path / "src", tmp_path / "out", progress=False)
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    _check_round_trip(t, expected)
    assert sorted(set(t.labels.tolist())) == [0, 1, 2, 3, 4]
    mlrc = protocol_for_table(t, sop_split="mlrc")
    official = protocol_for_table(t, sop_split="official")
    assert mlrc.trainval_classes.tolist() == [0, 1] and mlrc.test_classes.tolist() == [2, 3, 4]
    assert official.trainval_classes.tolist() == [0, 1, 2] and official.test_classes.tolist() == [3, 4]
    with pytest.raises(ValueError, match="sop_split must be one of"):
        protocol_for_table(t, sop_split="other")


def test_sop_rejects_a_class_in_both_files(tmp_path):
    make_fake_sop(tmp_path / "src", train_classes=(1, 2), test_classes=(2, 3))
    with pytest.raises(ValueError, match="class_id 2 is in both Ebay_train.txt and Ebay_test.txt"):
        prepare("sop", tmp_path / "src", tmp_path / "out", progress=False)


def test_inshop_round_trip_and_query_gallery_evaluation(tmp_path):
    expected = make_fake_inshop(tmp_path / "src")
    prepare("inshop", tmp_path / "src", tmp_path / "out", progress=False)
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    _check_round_trip(t, expected)
    p = protocol_for_table(t)
    assert p.eval_mode == "query_gallery"
    assert p.trainval_classes.tolist() == [0, 1] and p.test_classes.tolist() == [2, 3]
    test = t.subset(p.test_classes)
    q, g = p.query_gallery(test.meta["split"])
    assert len(q) == 4 and len(g) == 4 and set(test.meta["split"][q]) == {"query"}
    # Embeddings where each query matches its own item's gallery images perfectly except one wrong query:
    emb = torch.nn.functional.one_hot(torch.as_tensor(test.labels) - 2, 2).float()
    emb[q[0]] = torch.tensor([0.0, 1.0]) if test.labels[q[0]] == 2 else torch.tensor([1.0, 0.0])
    got = p.evaluate(emb, test.labels, test.meta["split"])
    assert got["precision_at_1"] == pytest.approx(0.75)  # 3 of 4 queries retrieve their item first
    # compared-to-self would also rank query against query: a different number
    assert dataset_protocol("cub200", test.labels).evaluate(emb, test.labels)["precision_at_1"] != 0.75


def test_inshop_header_count_mismatch_is_reported(tmp_path):
    make_fake_inshop(tmp_path / "src")
    f = tmp_path / "src" / "Eval" / "list_eval_partition.txt"
    lines = f.read_text().splitlines()
    f.write_text("\n".join(["99"] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="line 1 declares 99 images, the file lists 16"):
        prepare("inshop", tmp_path / "src", tmp_path / "out", progress=False)


@pytest.mark.skipif(
    not any(OMNIGLOT.glob("images_*.zip")), reason=f"Omniglot zips not found at ../shared/data/omniglot ({OMNIGLOT})"
)
def test_omniglot_real_zips_prepare_to_242_classes_and_4840_images(tmp_path):
    m = prepare("omniglot", OMNIGLOT, tmp_path / "out", progress=False)
    assert m["num_classes"] == 242 and m["num_images"] == 4840
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    ref = read_omniglot(OMNIGLOT)
    assert t.labels.tolist() == ref.labels.tolist() and t.class_names == ref.class_names
    for i in (0, 1234, 4839):
        assert t.images[i] == ref.images[i]
    x, y = ImageDataset(t, eval_transform(28))[4839]
    assert x.shape == (3, 28, 28) and y == 241


# --------------------------------------------------------------------------------------------- shards


def _records(n_classes=5, per_class=7, seed=0):
    recs, data = [], {}
    for c in range(n_classes):
        for j in range(per_class):
            rel = f"c{c}/{j}.jpg"
            data[rel] = jpeg(seed * 1000 + c * 50 + j)
            recs.append(Record(rel, c, f"class{c}", "train" if j % 2 else "test", (lambda b: lambda: b)(data[rel])))
    return recs[::-1], data  # reversed: the writer must sort


def test_many_shards_and_row_groups_random_access_matches_sources(tmp_path):
    recs, data = _records()
    m = write_shards(recs, tmp_path / "out", dataset="toy", max_shard_bytes=3000, row_group_rows=3, progress=False)
    assert len(m["shards"]) > 3 and all(sum(s["row_groups"]) == s["rows"] for s in m["shards"])
    for s in m["shards"]:
        path = tmp_path / "out" / s["path"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == s["sha256"]
        assert pq.ParquetFile(path).metadata.num_row_groups == len(s["row_groups"])
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache", cache_row_groups=2)
    assert t.labels.tolist() == sorted(t.labels.tolist())  # rows sorted by label: classes are contiguous
    order = np.random.default_rng(0).permutation(len(t))
    for i in order:
        rel = f"c{t.labels[i]}/"
        assert any(t.images[i] == data[k] for k in data if k.startswith(rel))
    assert len(t._source._lru) <= 2  # bounded: never more than cache_row_groups row groups held
    # subsets keep global rows: the same bytes through a view
    sub = t.subset([3, 1])
    assert set(sub.labels.tolist()) == {1, 3} and sub.class_names == ["class1", "class3"]
    full_idx = np.flatnonzero(np.isin(t.labels, [1, 3]))
    assert all(sub.images[k] == t.images[int(j)] for k, j in enumerate(full_idx))
    assert sub.take([2, 0]).labels.tolist() == [sub.labels[2], sub.labels[0]]


def test_manifest_contents_and_refusal_to_overwrite(tmp_path):
    recs, _ = _records(3, 2)
    m = write_shards(recs, tmp_path / "out", dataset="toy", info={"note": "x"}, progress=False)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == m
    assert m["schema_version"] == 2 and m["counts"] == {"images": 6, "classes": 3, "per_split": {"test": 3, "train": 3}}
    assert m["classes"] == [{"label": c, "name": f"class{c}", "count": 2} for c in range(3)]
    assert set(pq.ParquetFile(tmp_path / "out" / m["shards"][0]["path"]).schema_arrow.names) == {
        "image",
        "label",
        "class_name",
        "split",
        "relpath",
        "sha256",
        "index",
    }
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shards(recs, tmp_path / "out", dataset="toy", progress=False)
    write_shards(recs, tmp_path / "out", dataset="toy", overwrite=True, progress=False)


def test_reader_rejects_missing_or_unknown_manifests(tmp_path):
    with pytest.raises(ManifestError, match=f"^{tmp_path / 'manifest.json'}: no manifest here"):
        read_parquet_manifest(tmp_path)
    recs, _ = _records(2, 2)
    write_shards(recs, tmp_path / "out", dataset="toy", progress=False)
    mpath = tmp_path / "out" / "manifest.json"
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**m, "schema_version": 99}))
    with pytest.raises(ManifestError, match="schema_version 99 is not supported"):
        read_parquet_manifest(mpath)
    m["classes"][0]["count"] += 1  # the counts still sum to num_images: only the label column tells
    m["classes"][1]["count"] -= 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="label column disagrees"):
        read_parquet_manifest(mpath, cache_dir=tmp_path / "cache")


def test_writer_rejects_inconsistent_records(tmp_path):
    ok = jpeg(1)
    with pytest.raises(ValueError, match="duplicate image path 'a.jpg'"):
        write_shards([Record("a.jpg", 0, "x", "train", lambda: ok)] * 2, tmp_path / "o", dataset="t", progress=False)
    with pytest.raises(ValueError, match="label 0 has two class names"):
        write_shards(
            [Record("a.jpg", 0, "x", "train", lambda: ok), Record("b.jpg", 0, "y", "train", lambda: ok)],
            tmp_path / "o",
            dataset="t",
            progress=False,
        )
    with pytest.raises(CorruptImageError, match="b.jpg: not a readable image"):
        write_shards(
            [Record("a.jpg", 0, "x", "train", lambda: ok), Record("b.jpg", 1, "y", "train", lambda: b"junk")],
            tmp_path / "o",
            dataset="t",
            progress=False,
        )
    assert not (tmp_path / "o").exists()  # nothing half-written: the staged shards and the folders it made are gone


def test_corrupt_shard_fails_its_checksum_naming_the_shard(tmp_path):
    recs, _ = _records(3, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", max_shard_bytes=2000, row_group_rows=2, progress=False)
    victim = tmp_path / "out" / m["shards"][1]["path"]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(ShardChecksumError, match=f"shard {m['shards'][1]['path']} sha256 .* does not match"):
        read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")


def _rewrite_row(path: Path, row: int, new_image: bytes) -> None:
    """Replace one image's bytes in a shard, keeping its recorded sha256 (a silently corrupted row)."""
    pf = pq.ParquetFile(path)
    groups = [pf.read_row_group(i) for i in range(pf.metadata.num_row_groups)]
    t = pa.concat_tables(groups)
    images = t.column("image").to_pylist()
    images[row] = new_image
    t = t.set_column(t.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    pq.write_table(t, path, row_group_size=groups[0].num_rows)


def test_corrupt_row_raises_naming_shard_and_row(tmp_path):
    recs, data = _records(2, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    shard = tmp_path / "out" / m["shards"][0]["path"]
    _rewrite_row(shard, 5, jpeg(999))  # valid JPEG, wrong bytes for the row
    _rewrite_row(shard, 6, data["c1/2.jpg"][: len(data["c1/2.jpg"]) // 2])  # truncated JPEG
    mj = json.loads((tmp_path / "out" / "manifest.json").read_text())
    mj["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()  # shard-level check passes
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(mj))
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    ds = ImageDataset(t, eval_transform(16))
    ds[4]  # neighbours are fine
    with pytest.raises(CorruptImageError, match=r"shard shards/part-00000.parquet row 5 \(c1/1.jpg\).*sha256"):
        ds[5]
    # with row checks off, the truncated row is still caught when it fails to decode
    t2 = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache", verify_rows=False)
    with pytest.raises(CorruptImageError, match=r"shard shards/part-00000.parquet row 6 \(c1/2.jpg\)"):
        ImageDataset(t2, eval_transform(16))[6]
    with pytest.raises(CorruptImageError, match="row 5"):
        verify_shards(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_local_shards_are_hashed_once_per_cache(tmp_path, monkeypatch):
    import dml_core.shards.cache as shards

    recs, _ = _records(3, 3)
    m = write_shards(recs, tmp_path / "out", dataset="toy", max_shard_bytes=2000, row_group_rows=2, progress=False)
    assert len(m["shards"]) > 1
    calls = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert len(calls) == len(m["shards"])
    read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert len(calls) == len(m["shards"])  # stamps: unchanged files are not re-hashed
    (tmp_path / "out" / m["shards"][0]["path"]).touch()  # mtime changed -> hashed again
    read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert len(calls) == len(m["shards"]) + 1


def test_sharded_dataset_in_dataloader_workers_with_the_m_per_class_sampler(tmp_path):
    from dml_core.training.samplers import MPerClassBatchSampler

    recs, _ = _records(6, 5)
    write_shards(recs, tmp_path / "out", dataset="toy", max_shard_bytes=4000, row_group_rows=4, progress=False)
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    t.images[0]  # open handles in the parent: workers must not inherit them
    clone = pickle.loads(pickle.dumps(t))
    assert clone.labels.tolist() == t.labels.tolist() and clone.images[7] == t.images[7]
    ds = ImageDataset(t, eval_transform(16))
    sampler = MPerClassBatchSampler(ds.labels, m=2, classes_per_batch=3, iters_per_epoch=4, seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2)
    seen = 0
    for (x, y), idx in zip(loader, sampler):
        assert x.shape == (6, 3, 16, 16)
        assert y.tolist() == t.labels[idx].tolist()
        assert len(set(y.tolist())) == 3
        seen += 1
    assert seen == 4


# --------------------------------------------------------------------------------------------- CLI


def _cli(argv):
    from pipelines.data_cli import add_data_parser

    parser = argparse.ArgumentParser(prog="dmlrc")
    add_data_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_prepare_and_verify(tmp_path, capsys):
    from pipelines.data_cli import run_data

    make_fake_cub(tmp_path / "src")
    args = _cli(
        [
            "data",
            "prepare",
            "cub200",
            "--src",
            str(tmp_path / "src"),
            "--dest",
            str(tmp_path / "out"),
            "--no-progress",
            "--row-group-rows",
            "5",
        ]
    )
    assert run_data(args) == 0
    out, err = capsys.readouterr()
    assert "cub200: 12 images, 3 classes, 1 shards" in out and "official cub200 has 200 classes" in err
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"][0]["row_groups"] == [5, 5, 2]
    assert (
        run_data(
            _cli(["data", "verify", str(tmp_path / "out"), "--no-progress", "--cache-dir", str(tmp_path / "cache")])
        )
        == 0
    )
    assert "ok: cub200: 12 images, 3 classes, 1 shards verified" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _cli(["data", "prepare", "imagenet", "--src", "x", "--dest", "y"])
    # an existing destination is one `data error:` line naming it, exit 2 (no traceback)
    capsys.readouterr()
    assert (
        run_data(
            _cli(
                [
                    "data",
                    "prepare",
                    "cub200",
                    "--src",
                    str(tmp_path / "src"),
                    "--dest",
                    str(tmp_path / "out"),
                    "--no-progress",
                ]
            )
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("data error: ") and "\n" not in err and str(tmp_path / "out") in err
